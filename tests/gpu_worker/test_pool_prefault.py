"""pool_prefault: the ranges cover the pool in block order, populating leaves contents as they were,
waits while steps run, and never keeps a freed pool alive."""

import gc

import torch

from pagedserve.services.gpu_worker import pool_prefault
from pagedserve.services.gpu_worker.host_memory import huge_pages_zeros
from pagedserve.services.gpu_worker.pool_prefault import PAGE, PoolPrefault, chunk_ranges

SHAPE = (2, 700, 16, 3, 64)  # [2, num_blocks, block_size, Hkv, D]: a half is 4.1 MiB, not page-aligned in blocks


class _Pool:
    def __init__(self, num_layers: int = 2):
        self.kv_caches = [huge_pages_zeros(SHAPE, torch.bfloat16) for _ in range(num_layers)]


def test_ranges_cover_each_half_lowest_blocks_first():
    pool = _Pool()
    chunk = 1 << 20
    ranges = list(chunk_ranges(pool.kv_caches, chunk))
    half = pool.kv_caches[0].nbytes // 2
    per_half = -(-half // chunk)
    assert len(ranges) == 4 * per_half
    for address, length in ranges:
        assert address % PAGE == 0 and length % PAGE == 0 and 0 < length <= chunk + PAGE
    for t in pool.kv_caches:
        for h in range(2):
            start, stop = t.data_ptr() + h * half, t.data_ptr() + (h + 1) * half
            mine = [(a, n) for a, n in ranges if start - PAGE < a < stop]
            assert len(mine) == per_half
            assert mine[0][0] == start // PAGE * PAGE
            assert mine[-1][0] + mine[-1][1] >= stop
            assert all(a + n >= b for (a, n), (b, _m) in zip(mine, mine[1:], strict=False))  # no gap
    # the first chunk of every layer's K and V comes before any layer's second
    firsts = {t.data_ptr() + h * half for t in pool.kv_caches for h in range(2)}
    assert {a for a, _n in ranges[:4]} == firsts


def test_populating_keeps_contents_and_finishes():
    pool = _Pool()
    for t in pool.kv_caches:
        t.view(-1)[::997] = 1.5  # blocks in use, written before the thread gets to them
    expected = [t.clone() for t in pool.kv_caches]
    prefault = PoolPrefault(pool, pool.kv_caches, idle_after_s=0.0)
    assert prefault.start() is not None
    assert prefault.done.wait(60)
    assert prefault.num_populated == len(list(chunk_ranges(pool.kv_caches)))
    for t, e in zip(pool.kv_caches, expected, strict=True):
        assert torch.equal(t, e)


def test_waits_while_a_step_runs():
    pool = _Pool(1)
    prefault = PoolPrefault(pool, pool.kv_caches, idle_after_s=0.0)
    prefault.step_started()
    assert not prefault._idle()
    prefault.step_ended()
    assert prefault._idle()
    lagging = PoolPrefault(pool, pool.kv_caches, idle_after_s=3600.0)
    assert not lagging._idle()  # a step just ended: between steps, not idle


def test_a_freed_pool_stops_the_thread(monkeypatch):
    monkeypatch.setattr(pool_prefault, "POLL_S", 0.001)
    pool = _Pool(1)
    prefault = PoolPrefault(pool, pool.kv_caches, idle_after_s=3600.0)  # never idle: the thread polls
    thread = prefault.start()
    del pool
    gc.collect()
    thread.join(60)
    assert not thread.is_alive()
    assert prefault.num_populated == 0 and not prefault.done.is_set()


def test_stops_when_memory_runs_short(monkeypatch):
    monkeypatch.setattr(pool_prefault, "available_memory", lambda: pool_prefault.MIN_AVAILABLE)
    pool = _Pool(1)
    prefault = PoolPrefault(pool, pool.kv_caches, idle_after_s=0.0)
    thread = prefault.start()
    thread.join(60)
    assert not thread.is_alive()
    assert prefault.num_populated == 0 and not prefault.done.is_set()


def test_available_memory_reads_meminfo():
    available = pool_prefault.available_memory()
    assert available is not None and available > 0
