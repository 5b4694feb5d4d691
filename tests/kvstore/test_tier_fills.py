"""Tier fills under async scheduling (TierLink through WorkerPools, in process): a block that fills
while its last token is still unknown to the kvstore is planned as a fill (its parent's hash), the
worker names the hash it wrote, and the block is loadable from then on, whichever of that word and
the token comes first; a fill never run or never named leaves nothing behind."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.gpu_worker.tier_fills import TierFills
from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.kvstore.tier_index import TierIndex
from pagedserve.services.kvstore.tier_link import PENDING_STEPS, TierLink
from pagedserve.shared.block_hash import ROOT_HASH, hash_block, hash_full_blocks
from pagedserve.shared.messages import AllocCandidate, AllocRequest
from tests.kvstore.test_tier_pools import admit, checked, hashes, hello, pools_of
from tests.scheduler.fakes import make_request, make_stack, plan_step

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # block size 4: blocks [1-4], [5-8], then 9


def step(step_id: int, *candidates, filled=(), free=(), worker: str = "w1") -> AllocRequest:
    return AllocRequest(step_id, list(free), list(candidates), worker_id=worker, tier_filled=list(filled))


def decode(position: int, known: list[int] = ()) -> AllocCandidate:
    """One new slot at `position`; `known`: the tokens just learnt, the first at position - len(known)."""
    return AllocCandidate("a", 1, position + 1, token_ids=list(known), token_ids_start=position - len(known))


def run_to_the_fill(pools) -> list:
    """a's prompt is 1-5; steps 3-5 compute positions 5-7, each learning the token before its slot:
    block 1 is full after step 5, whose slot takes token 8, which the kvstore learns at step 6."""
    replies = [checked(pools, step(2, admit("a", TOKENS[:5])))]
    for step_id, position in ((3, 5), (4, 6), (5, 7)):
        known = TOKENS[position - 1:position] if position > 5 else []
        replies.append(checked(pools, step(step_id, decode(position, known))))
    return replies


def test_a_block_full_before_its_last_token_is_known_is_a_fill_the_worker_hashes():
    pools = pools_of(hello("w1"), hello("w2"))
    h = hashes(TOKENS)
    admitted, *decodes = run_to_the_fill(pools)
    assert admitted.tier_stores == [("a", 0, h[0])] and admitted.tier_fills == []
    assert [r.tier_fills for r in decodes] == [[], [], [("a", 1, h[0])]]
    assert hash_block(h[0], TOKENS[4:8]) == h[1]  # what the worker computes from the parent it is given
    learnt = checked(pools, step(6, decode(8, TOKENS[7:8])))
    assert (learnt.tier_stores, learnt.tier_fills) == ([], [])  # the worker writes it already
    assert pools.tier.is_pending(("ns", h[1]))  # its bytes reserved from here
    checked(pools, step(7, decode(9, [10]), filled=[("a", 1, h[1])]))
    assert ("ns", h[1]) in pools.tier and pools.stats()["tier_num_pending"] == 1  # block 0: not written yet
    checked(pools, AllocRequest(8, worker_id="w1", tier_written=h[:1]))
    b = checked(pools, step(2, admit("b", TOKENS), worker="w2"))
    assert (b.results[0].num_cached_tokens, b.results[0].tier_loads) == (8, [(0, h[0]), (1, h[1])])


def test_the_workers_word_may_come_before_the_kvstore_learns_the_token():
    pools = pools_of(hello("w1"), hello("w2"))
    h = hashes(TOKENS)
    run_to_the_fill(pools)
    checked(pools, step(6, decode(8), filled=[("a", 1, h[1])]))  # token 8 not learnt yet
    assert ("ns", h[1]) in pools.tier and not pools.tier.is_pending(("ns", h[1]))
    learnt = checked(pools, step(7, decode(9, TOKENS[7:9])))
    assert (learnt.tier_stores, learnt.tier_fills, pools.stats()["tier_num_pending"]) == ([], [], 1)


def test_a_fill_of_a_request_preempted_in_its_own_step_is_never_planned():
    pools = pools_of(hello("w1"))
    checked(pools, step(2, admit("a", TOKENS[:5])))
    checked(pools, step(3, decode(5)))
    checked(pools, step(4, decode(6, TOKENS[4:5])))
    link = pools.pools["w1"].manager.tier
    link.on_filled("a", 1, hashes(TOKENS)[0])
    link.free("a")  # the step's preemption: the fill is dropped with it
    assert link.take_fills() == [] and not link._filling


def test_a_fill_never_named_is_forgotten_and_its_late_write_deleted():
    pools = pools_of(hello("w1"))
    h = hashes(TOKENS)
    run_to_the_fill(pools)
    for step_id in range(6, 6 + PENDING_STEPS):
        checked(pools, step(step_id))
    pools.take_tier_evicted()
    checked(pools, step(6 + PENDING_STEPS, filled=[("a", 1, h[1])]))
    assert ("ns", h[1]) not in pools.tier and pools.take_tier_evicted() == [("ns", h[1])]


def test_a_fill_of_a_block_the_tier_holds_changes_nothing_there():
    pools = pools_of(hello("w1"), hello("w2"))
    h = hashes(TOKENS)
    checked(pools, step(2, admit("x", TOKENS), worker="w2"))
    checked(pools, step(3, filled=(), worker="w2"))
    checked(pools, AllocRequest(4, worker_id="w2", tier_written=h))
    run_to_the_fill(pools)
    learnt = checked(pools, step(6, decode(8, TOKENS[7:8])))
    assert learnt.tier_stores == [] and pools.stats()["tier_num_pending"] == 0
    checked(pools, step(7, filled=[("a", 1, h[1])]))
    assert ("ns", h[1]) in pools.tier and pools.take_tier_evicted() == []  # the same bytes, overwritten


def test_a_reset_confirms_the_fills_its_request_names_first():
    pools = pools_of(hello("w1"))
    h = hashes(TOKENS)
    run_to_the_fill(pools)
    checked(pools, AllocRequest(6, worker_id="w1", reset=True, tier_filled=[("a", 1, h[1])]))
    assert ("ns", h[1]) in pools.tier


def run_with_tier(max_steps_in_flight: int, prompts=(9, 14, 5), max_tokens: int = 19, budget: int = 16) -> int:
    """Requests through the scheduler, a BlockManager with a tier and a fake worker that writes what
    it is told (tier_blocks' rules: its fills as TierFills hashes them); the most blocks any
    generating request would recompute past its last partial one, were its worker lost at any step."""
    scheduler, _allocator, worker = make_stack(max_steps_in_flight=max_steps_in_flight, max_num_batched_tokens=budget)
    index = TierIndex(1 << 20)
    manager = BlockManager(256, 4, enable_prefix_caching=True, tier=TierLink(index, "ns", 1))
    fills = TierFills(4)

    class Pool:  # WorkerPools.apply's order: the request's confirmations, then its step
        @staticmethod
        def step(request: AllocRequest):
            manager.tier.confirm(request.tier_written)
            manager.tier.confirm_filled(request.tier_filled)
            return manager.step(request)
    for i, num_prompt_tokens in enumerate(prompts):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens))
    planned, worst = deque(), 0
    while scheduler.has_requests():
        if scheduler.can_schedule() and (not planned or scheduler.has_work_ahead()):
            planned.append(plan_step(scheduler, Pool))  # its alloc confirmed what the results named
            for request in scheduler.live_requests():
                if not request.num_output_tokens:
                    continue  # in its prefill: what it has not computed yet it computes anyway
                tokens = request.token_ids_between(0, request.num_tokens)
                needed = hash_full_blocks(tokens, 4, ROOT_HASH)[:(len(tokens) - 1) // 4]
                worst = max(worst, sum(("ns", h) not in index for h in needed))
            if scheduler.can_schedule() and scheduler.has_work_ahead():
                continue
        step = planned.popleft()
        result = worker.execute(step.plan)
        result.tier_written = [h for _r, _i, h in step.plan.tier_stores]
        result.tier_filled = [(r, i, h) for r, i, h, _b in fills.take_full(worker.requests, step.plan)]
        scheduler.on_result(result)
    manager.check_integrity()
    index.check_integrity()
    return worst


@pytest.mark.parametrize("max_steps_in_flight", [1, 2])
def test_no_known_token_follows_a_block_the_tier_lacks_sync_or_async(max_steps_in_flight):
    assert run_with_tier(max_steps_in_flight) == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2), st.lists(st.integers(1, 24), min_size=1, max_size=4), st.integers(1, 24),
       st.integers(4, 24))
def test_any_schedule_keeps_every_full_block_ahead_of_the_tokens_after_it(in_flight, prompts, max_tokens, budget):
    assert run_with_tier(in_flight, prompts, max_tokens, budget) == 0
