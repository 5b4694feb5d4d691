"""`python -m pagedserve.services.bench.kv_cache_speed`: one layer's decode attention (SmolLM2's
shape, the CPU kernel, permuted blocks) per model dtype (float32, bf16) over a pool of that dtype
against an int8 pool, per context length; min / median ms of interleaved rounds (bench.attention.timed)."""

from __future__ import annotations

import argparse
import random

import torch

from pagedserve.services.bench.attention import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, timed
from pagedserve.services.gpu_worker.attention import kv_quant
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decode_case(batch: int, context: int, seed: int = 0):
    """A float32 pool holding `batch` requests of `context` tokens on shuffled blocks, and queries."""
    per = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    ids = list(range(batch * per))
    random.Random(seed).shuffle(ids)
    tables = [ids[i * per:(i + 1) * per] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, len(ids), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    return meta, q, pool


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", default="256,1024,4000")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes, each against int8")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = TorchPagedBackend(use_kernel=True)
    dtypes = args.dtypes.split(",")
    print(f"batch={args.batch} threads={torch.get_num_threads()} (ms: min / median)")
    for context in (int(c) for c in args.contexts.split(",")):
        meta, q, pool = decode_case(args.batch, context)
        int8 = kv_quant.quantize(pool)
        def attend(query, cache, meta=meta):
            return lambda: backend.attend(query, cache, meta, HEAD_DIM**-0.5)

        fns = []
        for name in dtypes:
            qd = q.to(DTYPES[name])
            fns += [attend(qd, pool.to(DTYPES[name])), attend(qd, int8)]
        times = timed(fns, args.repeat)
        for i, name in enumerate(dtypes):
            (p_min, p_med), (i_min, i_med) = times[2 * i], times[2 * i + 1]
            print(f"context {context:5d} {name:8s}: pool {p_min:7.2f} / {p_med:7.2f}  int8 {i_min:7.2f} / {i_med:7.2f}"
                  f"  int8/{name} (median) {i_med / p_med:.2f}")


if __name__ == "__main__":
    main()
