"""`python -m pagedserve.services.bench.tier_store_cpu`: CPU-seconds per stored offload tier block, by
side: the compute side packing (tier_blocks.collect_stores: the process but its writer thread, so
torch's OpenMP threads count), the writer thread sending
(TierWriter) and Redis receiving (its process CPU, so use a Redis nobody else loads). A pool of
SmolLM2's shape; blocks go under their own key prefix, deleted after."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from types import SimpleNamespace

import redis
import torch

from pagedserve.services.gpu_worker import tier_blocks
from pagedserve.services.gpu_worker.pack_buffers import PackBuffers
from pagedserve.services.gpu_worker.tier_writer import TierWriter, writer_client
from pagedserve.shared.streams import Keys

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def pool(layers: int, num_blocks: int, block_size: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn((2, num_blocks, block_size, heads, head_dim), generator=generator).to(torch.bfloat16)
            for _ in range(layers)]


async def run(args) -> dict:
    kv_caches = pool(args.layers, args.pool_blocks, args.block_size, args.heads, args.head_dim)
    client = redis.Redis.from_url(args.redis_url)
    redis_pid = int(client.info("server")["process_id"])
    keys = Keys(prefix=args.prefix)
    writer = TierWriter(writer_client(args.redis_url, 30.0), keys, "bench")
    writer_tid = writer._thread.submit(threading.get_native_id).result()
    buffers = PackBuffers(tier_blocks.block_bytes(kv_caches), 64 << 20)
    requests = {"r": SimpleNamespace(block_ids=list(range(args.pool_blocks)),
                                     num_computed_tokens=args.pool_blocks * args.block_size)}
    num_steps = args.blocks // args.per_step
    before = cpu_seconds(redis_pid), cpu_seconds(os.getpid(), writer_tid), cpu_seconds(os.getpid())
    started = time.perf_counter()
    for step_id in range(num_steps):
        stores = [("r", (step_id * args.per_step + i) % args.pool_blocks,
                   (step_id * args.per_step + i).to_bytes(32, "big")) for i in range(args.per_step)]
        step = tier_blocks.TierStep()
        tier_blocks.collect_stores(kv_caches, args.block_size, requests, stores, step, buffers)
        writer.submit(step_id, step.stores, lambda b=step.buffer: buffers.give(b))
        await writer.wait_through(step_id - 1, 60.0)
    await writer.wait_through(num_steps, 60.0)
    wall = time.perf_counter() - started
    after = cpu_seconds(redis_pid), cpu_seconds(os.getpid(), writer_tid), cpu_seconds(os.getpid())
    written = len(writer.take_written())
    writer.close()
    deleted = sum(client.delete(*batch) for batch in batched(client.scan_iter(f"{args.prefix}:*", count=1000)))
    n = num_steps * args.per_step
    return {"blocks": n, "written": written, "deleted": deleted, "block_bytes": buffers.row_bytes,
            "compute_us_per_block": round((after[2] - before[2] - after[1] + before[1]) / n * 1e6, 1),
            "writer_us_per_block": round((after[1] - before[1]) / n * 1e6, 1),
            "redis_us_per_block": round((after[0] - before[0]) / n * 1e6, 1),
            "wall_s_noisy": round(wall, 2), "redis_url": args.redis_url}


def batched(items, size: int = 500):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.services.bench.tier_store_cpu")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefix", default=f"tiercpu{os.getpid()}")
    sizes = {"blocks": 1536, "per-step": 24, "pool-blocks": 512, "layers": 30, "heads": 3, "head-dim": 64,
             "block-size": 16}  # SmolLM2-135M in bf16, a cold random-64 run's stores
    for name, default in sizes.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    json.dump(asyncio.run(run(args)), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
