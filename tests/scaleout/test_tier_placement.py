"""Placement that knows the offload tier (services/scheduler/placement.py): a prompt block costs
nothing in the worker's pool, a load from the tier, a prefill nowhere; so a popular prefix in the
tier spreads its requests over workers sooner than one only a single pool holds."""

from __future__ import annotations

from pagedserve.services.scheduler.placement import TIER_LOAD_WEIGHT, Candidate, Router
from tests.scaleout.block_keys import block_keys
from tests.scaleout.test_placement import costs_of


def keys_of(tokens: list[int]) -> list[bytes]:
    return block_keys(tokens, 4, "m")


def test_a_pool_hit_costs_less_than_a_tier_hit_which_costs_less_than_a_prefill():
    k = keys_of(list(range(40)))  # 10 full blocks, an 11th with the last token
    router = Router("prefix", prefill_weight=1.0, decode_weight=1.0)
    router.index.apply("pool", stored=b"".join(k))
    nowhere = costs_of(router, k, 11, [Candidate("other", 0)])["other"]
    router.index.apply_tier(stored=b"".join(k))
    costs = costs_of(router, k, 11, [Candidate("pool", 0), Candidate("other", 0)])
    # pool: 1 block to prefill + 1 new; tier: 1 + 10 loads at TIER_LOAD_WEIGHT + 11 new; nowhere: 11 + 11
    assert costs == {"pool": 2.0, "other": 1 + 10 * TIER_LOAD_WEIGHT + 11}
    assert costs["pool"] < costs["other"] < nowhere == 22.0


def test_the_tier_counts_only_the_blocks_right_after_the_pools_prefix():
    k = keys_of(list(range(40)))
    router = Router("prefix", prefill_weight=1.0, decode_weight=0.0)
    router.index.apply("a", stored=b"".join(k[:2]))
    router.index.apply_tier(stored=b"".join(k[2:5] + k[6:]))  # a gap at block 5
    assert costs_of(router, k, 11, [Candidate("a", 0)]) == {"a": 9 - 3 * (1 - TIER_LOAD_WEIGHT)}
    router.index.apply_tier(removed=k[2])
    assert costs_of(router, k, 11, [Candidate("a", 0)]) == {"a": 9.0}
    router.index.apply_tier(stored=k[0], whole=True)  # a snapshot replaces what was known
    assert router.index.tier == {k[0]}


def picks_of(router: Router, k: list[bytes], num_requests: int) -> list[str]:
    """Every request shares the prefix; each placed one adds its 11 blocks to its worker's load."""
    load = {"a": 0, "b": 0}
    picks = []
    for _ in range(num_requests):
        chosen = router.choose(k, 11, [Candidate(w, load[w]) for w in load])[0]
        load[chosen] += 11
        picks.append(chosen)
    return picks


def test_one_popular_prefix_in_the_tier_spreads_over_the_workers_sooner():
    k = keys_of(list(range(40)))
    only_pool = Router("prefix", prefill_weight=4.0, decode_weight=1.0)
    only_pool.index.apply("a", stored=b"".join(k))
    with_tier = Router("prefix", prefill_weight=4.0, decode_weight=1.0)
    with_tier.index.apply("a", stored=b"".join(k))
    with_tier.index.apply_tier(stored=b"".join(k))
    # a holds the prefix: 4 * 1 + (load(a) + 1) against b's 4 * 11 + (load(b) + 11) without the
    # tier, 4 * (1 + 10 * TIER_LOAD_WEIGHT) + (load(b) + 11) with it; once placed, b holds it too
    assert picks_of(only_pool, k, 8) == ["a", "a", "a", "a", "a", "b", "b", "b"]
    assert picks_of(with_tier, k, 8) == ["a", "a", "b", "b", "a", "b", "a", "b"]
