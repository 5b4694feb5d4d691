"""The offload tier through real processes (kvstore, worker, scheduler on the real Redis, float32):
a prefix evicted from the worker's pool, or lost with the worker itself, is loaded from the tier
and gives token for token the greedy text its computation gave."""

from __future__ import annotations

import pytest

from pagedserve.shared.block_hash import hash_full_blocks, root_hash
from pagedserve.shared.messages import SamplingParams
from tests.services.conftest import TestApi, start_backend, wait_for

pytestmark = pytest.mark.slow

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int, num_tokens: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 30000 for i in range(num_tokens)]


@pytest.fixture(scope="module")
def small_pool_stack(tmp_path_factory):
    # 16 blocks: one 200-token prompt pushes another's prefix out of the pool; a step timeout that a
    # slow shared machine does not reach (a reset would empty the pool these tests count hits in); one
    # step a plan: a request's tier pins end STEPS_IN_FLIGHT steps after its admission, which a short
    # request in multi-step plans may not outlast (they end at the next request's steps instead)
    stack = start_backend(tmp_path_factory.mktemp("tier"), args={
        "worker": ["--dtype", "float32", "--num-blocks", "16", "--worker-id", "0"],
        "scheduler": ["--step-timeout", "300", "--num-scheduler-steps", "1"]})
    yield stack
    stack.close()


def run(api: TestApi, tokens: list[int]) -> tuple[list[int], dict, dict]:
    """The request's tokens and the kvstore's stats before it and once it has counted and freed it,
    and every block it stored is confirmed written (loadable). Every request of the module goes
    through here, so `before` counts every earlier one."""
    stack = api.stack
    before = stack.wait_kvstore_clean()
    (out,) = api.wait_finished([api.submit(tokens, GREEDY)], timeout=180)

    def settled():
        stats = stack.wait_kvstore_clean(since=before)
        return stats if stats["tier_num_pending"] == 0 else None

    return out.token_ids, before, wait_for(settled, 60, "the request's tier stores to be confirmed")


def gained(before: dict, after: dict, counter: str) -> int:
    """How much a kvstore counter grew (a restarted kvstore counts from 0)."""
    return after[counter] - (before[counter] if before["incarnation"] == after["incarnation"] else 0)


def num_stored(stack, tokens: list[int]) -> int:
    """How many of the prompt's full blocks the tier holds in Redis."""
    hashes = hash_full_blocks(tokens, BLOCK, root_hash(("smollm2",)))
    return sum(bool(stack.redis.keys(f"{stack.keys.prefix}:kvtier:*:{h.hex()}")) for h in hashes)


def test_a_prefix_evicted_from_the_pool_is_loaded_from_the_tier_with_the_same_text(small_pool_stack):
    stack = small_pool_stack
    api = TestApi(stack)
    first, other = prompt(1, 100), prompt(2, 200)
    computed, _, stats = run(api, first)
    assert stats["tier_num_blocks"] >= 6 and stats["tier_used_bytes"] > 0
    wait_for(lambda: num_stored(stack, first) == 6, 30, "the prompt's 6 full blocks written to the tier")
    run(api, other)  # 13 of 16 blocks: the first prompt's cached blocks are evicted from the pool
    loaded, before, stats = run(api, first)
    assert loaded == computed
    # 6 full blocks of 100 tokens: the pool kept the first 3 (freed last block first), the tier gives the rest
    assert gained(before, stats, "prefix_cache_hits") == 6 * BLOCK
    assert gained(before, stats, "prefix_cache_tier_hits") == 3 * BLOCK
    assert stats["integrity_ok"] and stats["tier_num_pinned"] == 0
    api.close()


def test_a_restarted_worker_serves_the_prefix_its_predecessor_computed(small_pool_stack):
    stack = small_pool_stack
    api = TestApi(stack)
    tokens = prompt(3, 90)
    computed, _, _ = run(api, tokens)
    wait_for(lambda: num_stored(stack, tokens) == 5, 30, "the prompt's 5 full blocks written to the tier")
    stack.kill("worker")
    stack.start("worker")
    loaded, before, after = run(api, tokens)
    assert loaded == computed
    # the new worker's pool starts empty: every cached block comes from the tier
    assert gained(before, after, "prefix_cache_hits") == gained(before, after, "prefix_cache_tier_hits") == 5 * BLOCK
    api.close()


@pytest.mark.parametrize("service", ["scheduler", "kvstore"])
def test_a_prefix_stays_cached_across_a_restart_of(small_pool_stack, service):
    """The scheduler's restart resets every pool (its blocks are forgotten), the kvstore's loses the
    index: the tier's contents stay in Redis and are found again."""
    stack = small_pool_stack
    api = TestApi(stack)
    tokens = prompt(4 if service == "scheduler" else 5, 85)
    computed, _, _ = run(api, tokens)
    wait_for(lambda: num_stored(stack, tokens) == 5, 30, "the prompt's 5 full blocks written to the tier")
    stack.kill(service)
    stack.start(service)
    loaded, before, after = run(api, tokens)
    assert loaded == computed
    assert after["incarnation"] == stack.incarnation("kvstore")
    assert gained(before, after, "prefix_cache_hits") == gained(before, after, "prefix_cache_tier_hits") == 5 * BLOCK
    api.close()


def test_blocks_lost_from_the_tier_are_computed_instead_and_stored_again(small_pool_stack):
    stack = small_pool_stack
    api = TestApi(stack)
    tokens = prompt(6, 100)
    computed, _, _ = run(api, tokens)
    wait_for(lambda: num_stored(stack, tokens) == 6, 30, "the prompt's 6 full blocks written to the tier")
    run(api, prompt(7, 200))  # pushes the prompt's blocks out of the pool
    for h in hash_full_blocks(tokens, BLOCK, root_hash(("smollm2",))):
        stack.redis.delete(*stack.redis.keys(f"{stack.keys.prefix}:kvtier:*:{h.hex()}"))
    missed_before = (stack.stats("scheduler") or {}).get("num_tier_missed_blocks_total", 0)
    assert run(api, tokens)[0] == computed  # the kvstore still lists them: the worker computes them
    missed = wait_for(lambda: (stack.stats("scheduler") or {}).get("num_tier_missed_blocks_total", 0)
                      - missed_before, 30, "the scheduler to count the missed loads")
    # the pool kept the first blocks (hits there, not stored again); those the tier missed are stored anew
    assert 1 <= missed <= 6
    wait_for(lambda: num_stored(stack, tokens) == missed, 30, "the computed blocks stored again")
    api.close()


def test_a_restarted_kvstore_keeps_the_tiers_lru_order(small_pool_stack):
    """Restarted with room for 12 blocks, the kvstore keeps the 12 most recently stored (the last
    prompt's), not whichever its scan of Redis finds first; the rest are deleted. Last in the
    module: it leaves the kvstore with that small tier."""
    stack = small_pool_stack
    api = TestApi(stack)
    older, newest = prompt(8, 100), prompt(9, 200)  # 6 and 12 full blocks
    run(api, older)
    computed, _, stats = run(api, newest)
    wait_for(lambda: num_stored(stack, newest) == 12, 30, "the last prompt's 12 full blocks written to the tier")
    block_bytes = stats["tier_used_bytes"] // stats["tier_num_blocks"]
    assert stats["tier_num_blocks"] > 12
    stack.kill("kvstore")
    stack.args["kvstore"] = ["--kv-offload-memory", str(12 * block_bytes)]
    stack.start("kvstore")
    newest_keys = {h.hex() for h in hash_full_blocks(newest, BLOCK, root_hash(("smollm2",)))}
    stored = {key.decode().rsplit(":", 1)[1] for key in stack.redis.keys(f"{stack.keys.prefix}:kvtier:*")}
    assert stored == newest_keys
    loaded, before, after = run(api, newest)
    assert loaded == computed
    assert gained(before, after, "prefix_cache_tier_hits") == 12 * BLOCK and after["tier_num_blocks"] == 12
    api.close()
