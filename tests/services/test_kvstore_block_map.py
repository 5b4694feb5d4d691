"""The kvstore publishes its pools' block map under keys.stats("block_map"), keyed by
worker id (two workers here, one pool each), on real Redis; rewritten at most once per
BLOCK_MAP_INTERVAL_S."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis

from pagedserve.services.kvstore.block_map import CACHED
from pagedserve.services.kvstore.loop import KvStoreLoop
from pagedserve.shared import redis_io
from pagedserve.shared.messages import WorkerHello
from pagedserve.shared.streams import Keys

REDIS_URL = "redis://127.0.0.1:6379/0"


async def _scenario() -> list[dict | None]:
    r = aioredis.Redis.from_url(REDIS_URL)
    keys = Keys(f"test-blockmap-{uuid.uuid4().hex[:10]}")
    try:
        kv = KvStoreLoop(r, keys, enable_prefix_caching=True, check_every_step=False)
        seen = [await redis_io.read_stats(r, keys, "block_map")]
        kv.pools.join(WorkerHello("w0", 4, 2, "m", 64))
        kv.pools.join(WorkerHello("w1", 3, 2, "m", 64))
        manager = kv.pools.pools["w0"].manager
        prompt = [7, 8, 9, 10, 11]
        manager.admit("a", len(prompt), len(prompt), prompt)
        await kv._write_stats(idle=True)
        seen.append(await redis_io.read_stats(r, keys, "block_map"))
        manager.free("a")
        kv.stats_dirty = True
        kv.block_map_interval_s = 3600.0  # however slow this machine, the next write is within it
        await kv._write_stats(idle=True)  # within the interval: the map is not rewritten yet ...
        seen.append(await redis_io.read_stats(r, keys, "block_map"))
        assert kv.stats_dirty  # ... but the loop comes back for it
        kv.last_block_map = time.monotonic() - kv.block_map_interval_s
        await kv._write_stats(idle=True)
        seen.append(await redis_io.read_stats(r, keys, "block_map"))
        return seen
    finally:
        await r.delete(keys.stats("block_map"), keys.stats("kvstore"))
        await r.aclose()


def test_block_map_is_published_per_worker_and_throttled():
    before, held, throttled, freed = asyncio.run(_scenario())
    assert before is None
    entry, idle_w1 = {"num_blocks": 4, "block_size": 2}, {"num_blocks": 3, "block_size": 2, "states": bytes(3)}
    assert held == {"workers": {"w0": {**entry, "states": bytes([1 | CACHED, 1 | CACHED, 1, 0])}, "w1": idle_w1}}
    assert throttled == held
    assert freed == {"workers": {"w0": {**entry, "states": bytes([CACHED, CACHED, 0, 0])}, "w1": idle_w1}}
