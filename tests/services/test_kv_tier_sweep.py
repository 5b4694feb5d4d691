"""The kvstore deletes orphaned tier writes on real Redis: keys under its tier prefix that its index
neither holds nor reserves, a bounded SCAN per pass, at most one pass per interval."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgpack
import redis.asyncio as aioredis

from pagedserve.services.kvstore.loop import KvStoreLoop
from pagedserve.services.kvstore.tier_sweep import TierSweep
from pagedserve.shared.kv_tier import tier_key, tier_lru_key
from pagedserve.shared.streams import Keys

REDIS_URL = "redis://127.0.0.1:6379/0"
HELD, RESERVED, ORPHAN, LATE = (bytes([n]) * 32 for n in range(1, 5))


async def _round(kv: KvStoreLoop) -> None:
    """Passes until the SCAN cursor comes back to 0: every key was seen once."""
    await kv._sweep_tier()
    while kv.sweep.cursor != 0:
        await kv._sweep_tier()


async def _scenario() -> tuple[set[str], set[str], int, set[str], set[str]]:
    r = aioredis.Redis.from_url(REDIS_URL)
    keys = Keys(f"test-h36p-sweep-{uuid.uuid4().hex[:10]}")
    names = {h: tier_key(keys, "ns", h) for h in (HELD, RESERVED, ORPHAN, LATE)}
    other = f"{keys.prefix}:other"
    try:
        kv = KvStoreLoop(r, keys, enable_prefix_caching=True, check_every_step=False, tier_capacity_bytes=1 << 20)
        kv.sweep = TierSweep(interval_s=0.0, count=1000)
        tier = kv.pools.tier
        assert tier.insert(("ns", HELD), 8) and tier.reserve(("ns", RESERVED), 8, owner="pool")
        await r.mset({names[HELD]: b"h", names[RESERVED]: b"r", names[ORPHAN]: b"o",
                      tier_lru_key(keys): b"not a block", other: b"x"})
        await _round(kv)
        first = {k.decode() for k in await r.keys(f"{keys.prefix}:*")}
        swept_first = kv.sweep.num_swept
        kv.sweep.next_at = time.monotonic() + 3600.0  # the next pass not due: a late write waits for it
        tier.cancel(("ns", RESERVED), "pool")
        await r.set(names[LATE], b"l")
        await kv._sweep_tier()
        second = {k.decode() for k in await r.keys(f"{keys.prefix}:*")}
        kv.sweep.next_at = 0.0
        await _round(kv)
        third = {k.decode() for k in await r.keys(f"{keys.prefix}:*")}
        await kv._write_stats(idle=True)  # the count reaches /metrics through the stats blob
        assert msgpack.unpackb(await r.get(keys.stats("kvstore")), raw=False)["tier_num_swept"] == 3
        return set(names.values()) | {other, tier_lru_key(keys)}, first, swept_first, second, third
    finally:
        await r.delete(*names.values(), other, tier_lru_key(keys), keys.stats("kvstore"), keys.stats("block_map"))
        await r.aclose()


def test_orphaned_tier_writes_are_swept_and_nothing_else():
    every, first, num_swept, not_due, later = asyncio.run(_scenario())
    held, reserved, orphan, late = (name for h in (HELD, RESERVED, ORPHAN, LATE) for name in every
                                    if name.endswith(h.hex()))
    assert num_swept == 1 and first == every - {orphan, late}  # held, reserved, the LRU and other keys stay
    assert not_due == first | {late}  # the next pass is not due yet
    assert later == every - {orphan, late, reserved}  # then the late write and the cancelled one's go
