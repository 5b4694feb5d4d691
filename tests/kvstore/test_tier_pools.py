"""The offload tier behind every worker's pool (WorkerPools + TierLink, in process): full blocks
are stored once, another pool admits them as loads, pins last until the step after the free,
the budget evicts least recently used blocks, and a reset or a lost worker ends what it held."""

from __future__ import annotations

from pagedserve.services.kvstore.tier_link import PENDING_STEPS
from pagedserve.services.kvstore.worker_pools import WorkerPools
from pagedserve.shared.block_hash import hash_full_blocks, root_hash
from pagedserve.shared.messages import AllocCandidate, AllocRequest, WorkerHello

BLOCK_BYTES = 100


def hello(worker_id: str, namespace: str = "ns") -> WorkerHello:
    return WorkerHello(worker_id, 8, 4, "m", 64, kv_tier_namespace=namespace, kv_block_bytes=BLOCK_BYTES)


def admit(request_id: str, tokens: list[int]) -> AllocCandidate:
    return AllocCandidate(request_id, len(tokens), len(tokens), is_waiting=True, token_ids=tokens)


def alloc(worker_id: str, step_id: int, *candidates, reset: bool = False, free=(), written=()) -> AllocRequest:
    return AllocRequest(step_id, list(free), list(candidates), reset=reset, worker_id=worker_id,
                        tier_written=list(written))


def hashes(tokens: list[int]) -> list[bytes]:
    return hash_full_blocks(tokens, 4, root_hash(("m",)))


def pools_of(*workers: WorkerHello, capacity_blocks: int = 16) -> WorkerPools:
    pools = WorkerPools(enable_prefix_caching=True, watermark=0.0, tier_capacity_bytes=capacity_blocks * BLOCK_BYTES)
    for worker in workers:
        pools.join(worker)
        pools.apply(alloc(worker.worker_id, 1, reset=True))
    return pools


def checked(pools: WorkerPools, request: AllocRequest):
    reply = pools.apply(request)
    assert pools.check_integrity() is None
    return reply


def test_a_block_one_worker_stored_is_loaded_by_the_other():
    pools = pools_of(hello("w1"), hello("w2"))
    tokens = list(range(1, 10))  # two full blocks and one token
    h = hashes(tokens)
    a = checked(pools, alloc("w1", 2, admit("a", tokens)))
    assert a.tier_stores == [("a", 0, h[0]), ("a", 1, h[1])] and a.results[0].tier_loads == []
    checked(pools, alloc("w1", 3, written=h))
    b = checked(pools, alloc("w2", 2, admit("b", tokens)))
    assert (b.results[0].num_cached_tokens, b.results[0].tier_loads) == (8, [(0, h[0]), (1, h[1])])
    assert b.results[0].new_block_ids == [0, 1, 2] and b.tier_stores == []
    assert [pools.tier.readers(("ns", x)) for x in h] == [1, 1]
    c = checked(pools, alloc("w1", 4, admit("c", tokens), free=["a"]))
    assert (c.results[0].num_cached_tokens, c.results[0].tier_loads) == (8, [])  # its own pool first
    checked(pools, alloc("w2", 3, free=["b"]))
    checked(pools, alloc("w2", 4))
    assert [pools.tier.readers(("ns", x)) for x in h] == [1, 1]  # step 2, which loads them, may still run
    checked(pools, alloc("w2", 5))
    assert [pools.tier.readers(("ns", x)) for x in h] == [0, 0]
    checked(pools, alloc("w2", 6, admit("d", tokens)))  # a pool hit on w2 now: no pin
    assert pools.tier.num_pinned == 0
    stats = pools.stats()
    assert (stats["prefix_cache_tier_hits"], stats["prefix_cache_hits"], stats["tier_num_blocks"]) == (8, 24, 2)


def test_the_pool_prefix_then_the_tier_rest():
    pools = pools_of(hello("w1"), hello("w2"))
    short, long = list(range(1, 6)), list(range(1, 14))  # 1 and 3 full blocks
    h = hashes(long)
    checked(pools, alloc("w1", 2, admit("a", long)))
    checked(pools, alloc("w1", 3, written=h))
    checked(pools, alloc("w2", 2, admit("b", short)))
    c = checked(pools, alloc("w2", 3, admit("c", long)))
    assert (c.results[0].num_cached_tokens, c.results[0].tier_loads) == (12, [(1, h[1]), (2, h[2])])


def test_other_formats_never_share_a_block():
    pools = pools_of(hello("w1", "ns"), hello("w2", "int8"))
    tokens = list(range(1, 10))
    checked(pools, alloc("w1", 2, admit("a", tokens)))
    b = checked(pools, alloc("w2", 2, admit("b", tokens)))
    assert (b.results[0].num_cached_tokens, len(b.tier_stores)) == (0, 2)


def test_the_budget_evicts_the_least_recently_used_block_but_never_a_pinned_one():
    pools = pools_of(hello("w1"), hello("w2"), capacity_blocks=2)
    first, second = list(range(1, 10)), list(range(50, 55))
    h1, h2 = hashes(first), hashes(second)
    checked(pools, alloc("w1", 2, admit("a", first), written=[]))
    checked(pools, alloc("w1", 3, written=h1))
    checked(pools, alloc("w2", 2, admit("b", first)))  # pins both blocks of first
    s = checked(pools, alloc("w1", 4, admit("c", second)))
    assert s.tier_stores == [] and pools.tier.num_refused == 1 and pools.take_tier_evicted() == []
    for step_id in range(3, 6):  # unpinned once the step that loaded them has surely run
        checked(pools, alloc("w2", step_id, free=["b"] if step_id == 3 else []))
    longer = second + [60, 61, 62, 63]
    s = checked(pools, alloc("w1", 5, admit("d", longer)))  # block 0 is a pool hit: not stored again
    assert s.tier_stores == [("d", 1, hashes(longer)[1])] and hashes(longer)[0] == h2[0]
    assert pools.take_tier_evicted() == [("ns", h1[0])]


def test_a_reset_empties_the_tier_and_a_lost_worker_ends_its_pins():
    pools = pools_of(hello("w1"), hello("w2"))
    tokens = list(range(1, 10))
    checked(pools, alloc("w1", 2, admit("a", tokens)))
    checked(pools, alloc("w1", 3, written=hashes(tokens)))
    checked(pools, alloc("w2", 2, admit("b", tokens)))
    pools.drop("w2")
    assert pools.check_integrity() is None and pools.tier.num_pinned == 0
    assert pools.reset_prefix_cache() == 2 + 2  # two pool blocks, two tier blocks
    assert len(pools.take_tier_evicted()) == 2 and len(pools.tier) == 0


def test_replies_carry_the_tiers_events_and_a_reset_the_whole_tier():
    pools = pools_of(hello("w1"), hello("w2"), capacity_blocks=2)
    tokens, other = list(range(1, 10)), list(range(50, 55))
    h = hashes(tokens)
    a = checked(pools, alloc("w1", 2, admit("a", tokens)))
    assert (a.tier_blocks_stored, a.tier_blocks_removed) == (b"", b"")  # planned stores are not loadable yet
    a = checked(pools, alloc("w1", 3, free=["a"], written=h))
    assert (a.tier_blocks_stored, a.tier_blocks_removed) == (h[0][:8] + h[1][:8], b"")
    b = checked(pools, alloc("w2", 2, admit("b", other)))  # evicts h[0], the least recently used
    assert (b.tier_blocks_stored, b.tier_blocks_removed) == (b"", h[0][:8])
    b = checked(pools, alloc("w2", 3, written=hashes(other)))
    assert (b.tier_blocks_stored, b.tier_blocks_removed) == (hashes(other)[0][:8], b"")
    reset = checked(pools, alloc("w1", 4, reset=True))
    assert reset.tier_blocks_whole and reset.tier_blocks_stored == h[1][:8] + hashes(other)[0][:8]


def test_a_preempted_request_whose_blocks_left_the_pool_resumes_from_the_tier():
    pools = WorkerPools(enable_prefix_caching=True, watermark=0.0, tier_capacity_bytes=16 * BLOCK_BYTES)
    pools.join(WorkerHello("w1", 4, 4, "m", 64, kv_tier_namespace="ns", kv_block_bytes=BLOCK_BYTES))
    pools.apply(alloc("w1", 1, reset=True))
    a_tokens, c_tokens = list(range(1, 9)), list(range(20, 28))  # 2 full blocks each: the whole pool
    checked(pools, alloc("w1", 2, admit("a", a_tokens), admit("c", c_tokens)))
    grow = checked(pools, alloc("w1", 3, AllocCandidate("c", 1, 9), AllocCandidate("a", 1, 9),
                                written=hashes(a_tokens) + hashes(c_tokens)))
    assert [r.status for r in grow.results] == ["ok", "preempted"]  # c's new block takes a's
    checked(pools, alloc("w1", 4, admit("d", list(range(40, 56))), free=["c"]))  # d's 4 blocks evict a's
    resume = checked(pools, alloc("w1", 5, admit("a", a_tokens + [99]), free=["d"]))
    result = resume.results[0]
    # 9 known tokens: both full blocks come from the tier, only the partial one is computed
    assert (result.status, result.num_cached_tokens, result.tier_loads) == ("ok", 8, list(enumerate(hashes(a_tokens))))


def test_a_planned_store_is_loadable_only_once_its_worker_wrote_it():
    pools = pools_of(hello("w1"), hello("w2"), hello("w3"))
    tokens = list(range(1, 10))
    h = hashes(tokens)
    checked(pools, alloc("w1", 2, admit("a", tokens)))
    b = checked(pools, alloc("w2", 2, admit("b", tokens)))  # reserved by w1: neither loaded nor stored again
    assert (b.results[0].num_cached_tokens, b.results[0].tier_loads, b.tier_stores) == (0, [], [])
    checked(pools, alloc("w2", 3, written=h))  # another worker's write confirms nothing of w1's
    assert [pools.tier.is_pending(("ns", x)) for x in h] == [True, True]
    checked(pools, alloc("w1", 3, written=h[:1]))
    c = checked(pools, alloc("w3", 2, admit("c", tokens)))
    assert (c.results[0].num_cached_tokens, c.results[0].tier_loads) == (4, [(0, h[0])])


def test_a_store_never_confirmed_is_dropped_and_its_late_write_deleted():
    pools = pools_of(hello("w1"), hello("w2"))
    tokens = list(range(1, 10))
    h = hashes(tokens)
    checked(pools, alloc("w1", 2, admit("a", tokens)))
    for step_id in range(3, 3 + PENDING_STEPS - 1):
        checked(pools, alloc("w1", step_id))
    assert pools.stats()["tier_num_pending"] == 2 and pools.take_tier_evicted() == []
    checked(pools, alloc("w1", 3 + PENDING_STEPS))
    assert pools.stats()["tier_num_pending"] == 0 and pools.stats()["tier_num_cancelled"] == 2
    assert pools.take_tier_evicted() == [("ns", x) for x in h]  # it may have been written
    checked(pools, alloc("w1", 4 + PENDING_STEPS, written=h))  # it was, late: deleted again, never loadable
    assert pools.take_tier_evicted() == [("ns", x) for x in h] and len(pools.tier) == 0
    b = checked(pools, alloc("w2", 2, admit("b", tokens)))  # the next worker to compute them stores them
    assert (b.results[0].num_cached_tokens, len(b.tier_stores)) == (0, 2)


def test_a_lost_worker_drops_its_reservations_and_a_reset_confirms_first():
    pools = pools_of(hello("w1"), hello("w2"))
    tokens, other = list(range(1, 10)), list(range(50, 55))
    checked(pools, alloc("w1", 2, admit("a", tokens)))
    checked(pools, alloc("w2", 2, admit("b", other)))
    pools.drop("w1")
    assert pools.check_integrity() is None and pools.take_tier_evicted() == [("ns", x) for x in hashes(tokens)]
    checked(pools, alloc("w2", 3, reset=True, written=hashes(other)))  # written before the reset: loadable
    assert ("ns", hashes(other)[0]) in pools.tier and pools.stats()["tier_num_pending"] == 0
