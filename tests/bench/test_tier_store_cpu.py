"""The tier store CPU bench (services/bench/tier_store_cpu.py) against the real Redis: every block
it packs is written, named written, and deleted after, under its own prefix."""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid

import redis

from pagedserve.services.bench import tier_store_cpu

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def test_the_bench_writes_each_block_once_and_leaves_nothing_behind():
    prefix = f"test-tiercpu-{uuid.uuid4().hex[:8]}"
    args = argparse.Namespace(redis_url=REDIS_URL, prefix=prefix, blocks=12, per_step=4, pool_blocks=8, layers=2,
                              heads=1, head_dim=8, block_size=4)
    result = asyncio.run(tier_store_cpu.run(args))
    assert {k: result[k] for k in ("blocks", "written", "deleted", "block_bytes")} == {
        "blocks": 12, "written": 12, "deleted": 12, "block_bytes": 2 * 2 * 4 * 8 * 2}
    assert min(result[k] for k in ("compute_us_per_block", "writer_us_per_block", "redis_us_per_block")) >= 0
    assert list(redis.Redis.from_url(REDIS_URL).scan_iter(f"{prefix}:*")) == []
