"""Placement (services/scheduler/placement.py): the prefix index fed by KV events, and the
router's cost = prefill_weight x uncached prompt blocks + decode_weight x load blocks."""

from __future__ import annotations

import time

import pytest

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.scheduler.placement import (
    PREDICTED_TTL_S,
    Candidate,
    PrefixIndex,
    Router,
    split_keys,
)
from pagedserve.shared.config_error import ConfigError
from pagedserve.shared.messages import AllocCandidate, AllocRequest
from pagedserve.shared.scheduler_config import SchedulerConfig
from tests.scaleout.block_keys import block_keys

BS = 4


def keys_of(tokens: list[int], model: str = "m", salt: str = "") -> list[bytes]:
    return block_keys(tokens, BS, model, salt)


def costs_of(router: Router, keys: list[bytes], num_blocks: int, candidates: list[Candidate]) -> dict[str, float]:
    """What choose() weighs: the costs over the overlaps of every key but the last block's."""
    keys = keys[:num_blocks - 1]
    return router.costs(keys, num_blocks, router.index.overlaps(keys, [c.worker_id for c in candidates]), candidates)


def test_block_keys_match_the_kvstores_events():
    """What the scheduler hashes is what the kvstore reports stored for the same prompt."""
    manager = BlockManager(16, BS, enable_prefix_caching=True, hash_keys=("m",), record_events=True)
    tokens = list(range(1, 11))  # two full blocks and a partial one
    manager.step(AllocRequest(0, [], [AllocCandidate("a", 10, 10, is_waiting=True, token_ids=tokens)]))
    stored, removed, cleared = manager.take_kv_events()
    assert stored == b"".join(keys_of(tokens)) and len(keys_of(tokens)) == 2
    assert (removed, cleared) == (b"", False)
    assert manager.take_kv_events() == (b"", b"", False)  # drained
    assert keys_of(tokens, salt="s") != keys_of(tokens) and keys_of(tokens, model="n") != keys_of(tokens)


def test_evictions_and_resets_are_reported_as_removed_and_cleared():
    manager = BlockManager(2, BS, enable_prefix_caching=True, hash_keys=("m",), record_events=True)
    first = [1] * 8
    manager.step(AllocRequest(0, [], [AllocCandidate("a", 8, 8, is_waiting=True, token_ids=first)]))
    manager.take_kv_events()
    second = [2] * 8  # a different prefix: both cached free blocks are evicted for it
    manager.step(AllocRequest(1, ["a"], [AllocCandidate("b", 8, 8, is_waiting=True, token_ids=second)]))
    stored, removed, cleared = manager.take_kv_events()
    assert stored == b"".join(keys_of(second)) and not cleared
    assert sorted(split_keys(removed)) == sorted(keys_of(first))  # evicted tail first
    manager.reset_prefix_cache()
    assert manager.take_kv_events() == (b"", b"", True)
    manager.check_integrity()


def test_index_overlap_counts_leading_blocks_per_worker():
    index = PrefixIndex()
    k = keys_of(list(range(16)))  # 4 blocks
    index.apply("w1", stored=b"".join(k[:3]))
    index.apply("w2", stored=k[0] + k[2] + k[3])  # a hole after the first block
    assert index.overlaps(k, ["w1", "w2", "w3"]) == {"w1": 3, "w2": 1, "w3": 0}
    index.apply("w1", removed=k[1])
    assert index.overlaps(k, ["w1"]) == {"w1": 1}
    index.apply("w2", stored=k[1], cleared=True)  # cleared first, then the new block
    assert index.overlaps(k, ["w2"]) == {"w2": 0} and index.num_cached("w2") == 1
    index.drop("w1")
    assert index.num_cached("w1") == 0 and index.overlaps(k, ["w1", "w2"]) == {"w1": 0, "w2": 0}


def test_prefix_router_prefers_the_worker_holding_the_prefix_until_load_outweighs_it():
    router = Router("prefix", prefill_weight=1.0, decode_weight=1.0)
    k = keys_of(list(range(40)))  # 10 full blocks
    router.index.apply("b", stored=b"".join(k))
    # b holds all 10 blocks: cost(a) = 11 + (0 + 11), cost(b) = 1 + (5 + 1)
    assert router.choose(k, 11, [Candidate("a", 0), Candidate("b", 5)])[0] == "b"
    assert costs_of(router, k, 11, [Candidate("a", 0), Candidate("b", 5)]) == {"a": 22.0, "b": 7.0}
    # b's load of 25 blocks outweighs the 20 it would save: 1 + 26 > 22
    assert router.choose(k, 11, [Candidate("a", 0), Candidate("b", 25)])[0] == "a"


def test_prefix_router_spreads_equal_costs_by_load_then_in_turn():
    router = Router("prefix")
    assert router.choose([], 2, [Candidate("a", 4), Candidate("b", 2)])[0] == "b"
    picks = [router.choose([], 2, [Candidate("a", 0), Candidate("b", 0)])[0] for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_weights_scale_each_side():
    k = keys_of(list(range(40)))
    router = Router("prefix", prefill_weight=0.0, decode_weight=1.0)  # load once it runs there
    router.index.apply("b", stored=b"".join(k))
    assert router.choose(k, 11, [Candidate("a", 0), Candidate("b", 9)])[0] == "b"  # 0 + 11 > 9 + 1
    assert router.choose(k, 11, [Candidate("a", 0), Candidate("b", 20)])[0] == "a"
    router = Router("prefix", prefill_weight=10.0, decode_weight=1.0)
    router.index.apply("b", stored=b"".join(k))
    assert router.choose(k, 11, [Candidate("a", 0), Candidate("b", 90)])[0] == "b"


def test_round_robin_ignores_cache_and_load():
    router = Router("round-robin")
    k = keys_of(list(range(8)))
    router.index.apply("a", stored=b"".join(k))
    picks = [router.choose(k, 2, [Candidate("b", 0), Candidate("a", 100)])[0] for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


@pytest.mark.parametrize("mode, prefill, decode", [("random", 1.0, 1.0), ("prefix", -1.0, 1.0),
                                                   ("prefix", 0.0, 0.0)])
def test_bad_router_config_is_refused(mode, prefill, decode):
    with pytest.raises(ConfigError):
        SchedulerConfig(router=mode, prefill_weight=prefill, decode_weight=decode)


def test_no_candidate_is_an_error():
    with pytest.raises(ValueError):
        Router().choose([], 1, [])


def test_a_placed_requests_blocks_count_as_cached_there_until_an_event_or_the_ttl():
    router = Router("prefix")
    k = keys_of(list(range(40)))  # 10 blocks, cached nowhere yet
    first = router.choose(k, 11, [Candidate("a", 0), Candidate("b", 0)])[0]
    other = "b" if first == "a" else "a"
    # the second of a burst follows the first, though no event has come yet
    assert router.choose(k, 11, [Candidate(first, 5), Candidate(other, 0)])[0] == first
    now = time.monotonic()
    assert router.index.overlaps(k, [first], now=now + PREDICTED_TTL_S + 1) == {first: 0}  # expired
    router.index.apply(first, removed=k[3])  # the pool says block 3 is gone: the prediction too
    assert router.index.overlaps(k, [first, other]) == {first: 3, other: 0}
    router.index.apply(first, stored=b"".join(k))  # real now: no expiry
    assert router.index.overlaps(k, [first], now=now + PREDICTED_TTL_S + 1) == {first: 10}
    router.index.drop(first)
    assert router.index.overlaps(k, [first]) == {first: 0}
