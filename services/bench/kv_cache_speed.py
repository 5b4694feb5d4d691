"""`python -m pagedserve.services.bench.kv_cache_speed`: one layer's decode attention (SmolLM2's
shape, the CPU kernel, permuted blocks) over a bf16 pool against an int8 pool, per context length;
min / median ms of interleaved rounds (bench.attention.timed)."""

from __future__ import annotations

import argparse
import random

import torch

from pagedserve.services.bench.attention import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, timed
from pagedserve.services.gpu_worker.attention import kv_quant
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend


def decode_case(batch: int, context: int, seed: int = 0):
    """A bf16 pool and its int8 copy holding `batch` requests of `context` tokens on shuffled blocks."""
    per = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    ids = list(range(batch * per))
    random.Random(seed).shuffle(ids)
    tables = [ids[i * per:(i + 1) * per] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, len(ids), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    return meta, q, pool, kv_quant.quantize(pool)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="256,1024,4000")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = TorchPagedBackend(use_kernel=True)
    print(f"batch={args.batch} threads={torch.get_num_threads()} (ms: min / median)")
    for context in (int(c) for c in args.contexts.split(",")):
        meta, q, bf16, int8 = decode_case(args.batch, context)
        def attend(cache, q=q, meta=meta):
            return lambda: backend.attend(q, cache, meta, HEAD_DIM**-0.5)

        (b_min, b_med), (i_min, i_med) = timed([attend(bf16), attend(int8)], args.repeat)
        print(f"context {context:5d}: bf16 {b_min:7.2f} / {b_med:7.2f}  int8 {i_min:7.2f} / {i_med:7.2f}"
              f"  int8/bf16 (median) {i_med / b_med:.2f}")


if __name__ == "__main__":
    main()
