"""The kvstore's per-worker table (services/kvstore/worker_pools.py): one pool per worker,
joins and drops touch no other worker, replies carry their pool's KV events."""

from __future__ import annotations

from pagedserve.services.kvstore.worker_pools import WorkerPools
from pagedserve.shared.messages import ALLOC_OK, AllocCandidate, AllocRequest, WorkerHello
from tests.scaleout.block_keys import block_keys


def hello(worker_id: str, num_blocks: int = 8) -> WorkerHello:
    return WorkerHello(worker_id, num_blocks, 4, "m", 64)


def admit(request_id: str, tokens: list[int]) -> AllocCandidate:
    return AllocCandidate(request_id, len(tokens), len(tokens), is_waiting=True, token_ids=tokens)


def alloc(worker_id: str, step_id: int, *candidates, reset: bool = False, free=()) -> AllocRequest:
    return AllocRequest(step_id, list(free), list(candidates), reset=reset, worker_id=worker_id)


def two_workers() -> WorkerPools:
    pools = WorkerPools(enable_prefix_caching=True, watermark=0.0)
    pools.join(hello("w1", 8), "inc1")
    pools.join(hello("w2", 6), "inc2")
    for worker_id in ("w1", "w2"):
        assert pools.apply(alloc(worker_id, 1, reset=True)).all_blocks_cleared
    return pools


def test_each_worker_allocates_from_its_own_pool():
    pools = two_workers()
    tokens = list(range(1, 10))
    a = pools.apply(alloc("w1", 2, admit("a", tokens)))
    b = pools.apply(alloc("w2", 2, admit("b", tokens)))
    assert (a.worker_id, b.worker_id) == ("w1", "w2")
    assert [r.status for r in a.results + b.results] == [ALLOC_OK, ALLOC_OK]
    assert a.results[0].new_block_ids == b.results[0].new_block_ids == [0, 1, 2]  # ids are per pool
    assert (a.num_blocks, b.num_blocks) == (8, 6) and (a.num_free_blocks, b.num_free_blocks) == (5, 3)
    assert a.blocks_stored == b.blocks_stored == b"".join(block_keys(tokens, 4, "m"))
    assert b.results[0].num_cached_tokens == 0  # w1's prefix is not w2's
    assert pools.check_integrity() is None
    stats = pools.stats()
    assert stats["num_held_blocks"] == 6 and stats["num_blocks"] == 14
    assert {w: s["num_held_blocks"] for w, s in stats["workers"].items()} == {"w1": 3, "w2": 3}


def test_a_join_and_a_drop_leave_the_other_workers_alone():
    pools = two_workers()
    pools.apply(alloc("w1", 2, admit("a", list(range(1, 10)))))
    pools.join(hello("w3"), "inc3")
    assert pools.pools["w1"].manager.has_request("a") and pools.pools["w1"].synced
    pools.apply(alloc("w2", 2, admit("b", list(range(1, 6)))))
    assert pools.drop("w2") == 2  # its two blocks go with it
    assert sorted(pools.pools) == ["w1", "w3"] and pools.num_held_blocks == 3
    assert pools.check_integrity() is None
    reply = pools.apply(alloc("w2", 3, admit("c", [1, 2])))  # a dropped worker: an empty answer
    assert reply.results == [] and reply.worker_id == "w2"


def test_a_restarted_worker_starts_empty_and_waits_for_the_reset():
    pools = two_workers()
    pools.apply(alloc("w1", 2, admit("a", list(range(1, 10)))))
    queries = pools.stats()["prefix_cache_queries"]
    pools.join(hello("w1", 8), "inc1-new")  # the same id, a new process
    assert pools.pools["w1"].manager.num_held_blocks == 0
    assert pools.apply(alloc("w1", 3, admit("b", [1, 2]))).results == []  # before its reset: refused
    reply = pools.apply(alloc("w1", 4, admit("b", [1, 2]), reset=True))
    assert reply.all_blocks_cleared and reply.results[0].status == ALLOC_OK
    assert pools.stats()["prefix_cache_queries"] == queries + 2  # counters never go down


def test_redelivered_steps_are_dropped_per_worker():
    pools = two_workers()
    assert pools.apply(alloc("w1", 5, admit("a", [1, 2]))) is not None
    assert pools.apply(alloc("w1", 5, admit("a", [1, 2]))) is None
    assert pools.apply(alloc("w2", 2, admit("b", [1, 2]))) is not None  # w2 counts its own steps


def test_prefix_cache_reset_clears_every_pool_and_is_reported():
    pools = two_workers()
    pools.apply(alloc("w1", 2, admit("a", list(range(1, 10))), ))
    pools.apply(alloc("w2", 2, admit("b", list(range(1, 10)))))
    assert pools.reset_prefix_cache() == 4
    reply = pools.apply(alloc("w1", 3, free=["a"]))
    assert reply.all_blocks_cleared and reply.blocks_stored == b""
    assert pools.check_integrity() is None
