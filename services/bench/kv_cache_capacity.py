"""`python -m pagedserve.services.bench.kv_cache_capacity`: KV blocks in a CPU budget per pool
storage, and how many sequences of --tokens the kvstore's BlockManager holds at once before it
refuses one (where the scheduler starts preempting)."""

from __future__ import annotations

import argparse

import torch

from pagedserve.services.gpu_worker.kv_pool import bytes_per_block, num_blocks_for
from pagedserve.services.gpu_worker.model.llama import build_model
from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.shared.config import EngineConfig

STORAGES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def concurrent_sequences(num_blocks: int, block_size: int, tokens: int) -> int:
    manager = BlockManager(num_blocks, block_size)
    n = 0
    while manager.can_allocate(f"r{n}", tokens):
        manager.allocate_slots(f"r{n}", tokens)
        n += 1
    manager.check_integrity()
    return n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory)
    model = build_model(args.model, torch.float32, torch.device("cpu")).config
    print(f"{args.model} at {args.kv_cache_memory}, sequences of {args.tokens} tokens")
    for name, dtype in STORAGES.items():
        n = num_blocks_for(config, model, dtype, torch.device("cpu"))
        print(f"{name:9s} bytes/block={bytes_per_block(model, config.block_size, dtype):8d} blocks={n:6d} "
              f"sequences={concurrent_sequences(n, config.block_size, args.tokens)}")


if __name__ == "__main__":
    main()
