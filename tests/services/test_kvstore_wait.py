"""How long the kvstore's read waits (KvStoreLoop._block_ms): until the next stats write or
integrity check falls due, else a second; never a fixed short poll while busy."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pagedserve.services.kvstore import loop as kv_loop
from pagedserve.services.kvstore.loop import KvStoreLoop
from pagedserve.shared.streams import Keys


@pytest.fixture
def kv() -> KvStoreLoop:
    loop = KvStoreLoop(None, Keys("test-kv-wait"), check_every_step=False)
    loop.stats_dirty = False
    return loop


def test_nothing_pending_waits_a_second(kv):
    assert kv._block_ms() == 1000


def test_dirty_stats_wait_until_their_write_is_due(kv):
    kv.stats_dirty, kv.last_stats = True, time.monotonic()
    assert 200 <= kv._block_ms() <= kv_loop.STATS_INTERVAL_S * 1000
    kv.last_stats -= 10  # overdue: read without waiting
    assert kv._block_ms() == 1


def test_a_change_waits_until_the_quiet_integrity_check(kv):
    now = time.monotonic()
    kv.last_integrity, kv.last_change = now - 1, now
    assert 450 <= kv._block_ms() <= kv_loop.QUIET_S * 1000
    kv.last_integrity = now - kv_loop.INTEGRITY_INTERVAL_S - 1  # the busy-time check is overdue
    assert kv._block_ms() == 1
    kv.check_every_step = True  # checked after every step: nothing to wait for
    assert kv._block_ms() == 1000


def test_no_quiet_check_while_requests_hold_blocks(kv):
    now = time.monotonic()
    kv.last_integrity, kv.last_change = now - 2, now - 1  # quiet for a second: a slow step
    kv.pools = SimpleNamespace(num_held_blocks=12, pools={})  # ... but requests still hold blocks
    assert not kv._integrity_due(now, idle=True)
    assert kv._block_ms() > 1000 * kv_loop.QUIET_S  # only the 10 s check or the 1 s read bound
    kv.pools = SimpleNamespace(num_held_blocks=0, pools={})  # all freed: the burst is over
    assert kv._integrity_due(now, idle=True)


def test_a_slow_busy_time_check_waits_longer_for_the_next(kv, monkeypatch):
    """A walk over a huge pool costs at most WALK_SHARE of the time while busy."""
    clock = [100.0]
    monkeypatch.setattr(kv_loop.time, "monotonic", lambda: clock[0])

    def slow_check():
        clock[0] += 0.5  # the walk takes half a second
        return None

    kv.pools = SimpleNamespace(check_integrity=slow_check, num_held_blocks=12, pools={})
    kv._check_integrity()
    assert kv.integrity_interval_s == 0.5 / kv_loop.WALK_SHARE
    kv.last_change = clock[0] + 1  # busy: a step changed the pool since
    clock[0] += kv_loop.INTEGRITY_INTERVAL_S + 1
    assert not kv._integrity_due(clock[0], idle=False)
    clock[0] = kv.last_integrity + 0.5 / kv_loop.WALK_SHARE
    assert kv._integrity_due(clock[0], idle=False)
