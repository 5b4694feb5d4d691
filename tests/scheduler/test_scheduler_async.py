"""Async scheduling (max_steps_in_flight=2): step N+1 is planned before step N's result.

Driven as the scheduler service drives it (fakes.run_pipelined_step). Exact plans for one
request; for mixed workloads, with chunking, preemption, forks, aborts and EOS, the same
outputs as the synchronous schedule and every block back in the pool.
"""

import zlib
from collections import deque

import pytest

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.shared.messages import AllocCandidate, CachedRequestData
from pagedserve.shared.parallel_sampling import child_request_ids
from tests.scheduler.fakes import (
    EOS,
    FakeWorker,
    make_request,
    make_stack,
    run_pipelined_step,
    run_pipelined_until_done,
    run_until_done,
    token_at,
)
from tests.scheduler.outcomes import finish_reasons, outputs_by_request


def test_the_next_decode_is_planned_before_the_result_and_max_tokens_is_never_overrun():
    scheduler, allocator, worker = make_stack(max_steps_in_flight=2)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=4))
    planned = deque()
    assert run_pipelined_step(scheduler, allocator, worker, planned) is None  # step 0 planned, no result yet
    first = run_pipelined_step(scheduler, allocator, worker, planned)  # plans step 1, reads step 0
    assert first.result.step_id == 0 and [p.plan.step_id for p in planned] == [1]
    step1 = planned[0]
    # position 10's token is being sampled by step 0: the kvstore learns no token yet
    assert step1.alloc_request.candidates == [AllocCandidate("a", 1, 10, token_ids=[], token_ids_start=10)]
    assert step1.plan.cached_requests == [CachedRequestData("a", [], 10, 1)]
    records = [first]
    while scheduler.has_requests():
        record = run_pipelined_step(scheduler, allocator, worker, planned)
        records.append(record) if record is not None else None
    # then one token learnt per step, one step behind the slots
    assert [r.alloc_request.candidates for r in records[2:4]] == [
        [AllocCandidate("a", 1, 11, token_ids=[token_at("a", 10)], token_ids_start=10)],
        [AllocCandidate("a", 1, 12, token_ids=[token_at("a", 11)], token_ids_start=11)],
    ]
    assert [r.plan.num_scheduled_tokens for r in records] == [10, 1, 1, 1, 0]  # no fifth token computed
    assert records[-1].alloc_request.free_request_ids == ["a"]
    assert outputs_by_request(records) == {"a": [token_at("a", p) for p in range(10, 14)]}
    assert finish_reasons(records) == {"a": "length"}
    assert allocator.num_free_blocks == allocator.num_blocks and worker.requests == {}


def eos_at_12(request_id: str, position: int) -> int:
    return EOS if position == 12 else token_at(request_id, position)


def test_a_token_after_eos_is_computed_once_and_dropped():
    scheduler, allocator, worker = make_stack(max_steps_in_flight=2, token_fn=eos_at_12)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=10))
    records = run_pipelined_until_done(scheduler, allocator, worker)
    assert outputs_by_request(records) == {"a": [token_at("a", 10), token_at("a", 11), EOS]}
    assert finish_reasons(records) == {"a": "stop"}
    # step 3 was planned before step 2's EOS was read: its token is wasted, nothing else
    assert [r.plan.num_scheduled_tokens for r in records] == [10, 1, 1, 1, 0]
    assert [t.token_id for t in records[3].result.sampled] == [token_at("a", 13)]
    assert records[3].deltas == []
    assert records[4].plan.finished_request_ids == ["a"]
    assert allocator.num_free_blocks == allocator.num_blocks and worker.requests == {}


def sometimes_eos(request_id: str, position: int) -> int:
    return EOS if zlib.crc32(f"eos:{request_id}:{position}".encode()) % 13 == 0 else token_at(request_id, position)


def add_mix(scheduler, n: int = 12) -> None:
    for i in range(n):
        scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=5 + 7 * i % 40, max_tokens=3 + 5 * i % 17))


@pytest.mark.parametrize("num_blocks", [256, 24])  # 24: the pool preempts
def test_the_outputs_are_those_of_the_synchronous_schedule(num_blocks):
    runs = []
    for max_steps_in_flight in (1, 2):
        scheduler, allocator, worker = make_stack(max_num_seqs=6, max_num_batched_tokens=16, num_blocks=num_blocks,
                                                  token_fn=sometimes_eos, max_steps_in_flight=max_steps_in_flight)
        add_mix(scheduler)
        run = run_pipelined_until_done if max_steps_in_flight == 2 else run_until_done
        records = run(scheduler, allocator, worker)
        allocator.check_integrity()
        assert allocator.num_free_blocks == num_blocks and worker.requests == {}
        runs.append((outputs_by_request(records), finish_reasons(records), scheduler.stats()))
    (sync_out, sync_reasons, _), (async_out, async_reasons, stats) = runs
    assert async_out == sync_out and async_reasons == sync_reasons
    assert set(async_reasons.values()) == {"stop", "length"}
    if num_blocks == 24:
        assert stats.num_preemptions_total > 0


def test_forks_run_the_same_with_steps_in_flight():
    runs = []
    for max_steps_in_flight in (1, 2):
        scheduler, _, worker = make_stack(max_num_batched_tokens=8, max_steps_in_flight=max_steps_in_flight)
        allocator = BlockManager(64, 4, watermark=0.0)  # the counting double does not fork
        scheduler.add_request(make_request("r", num_prompt_tokens=22, max_tokens=5, n=3))
        run = run_pipelined_until_done if max_steps_in_flight == 2 else run_until_done
        records = run(scheduler, allocator, worker)
        allocator.check_integrity()
        assert allocator.num_free_blocks == allocator.num_blocks and worker.requests == {}
        assert worker.block_copies  # each child copied the shared partial block before writing
        runs.append(outputs_by_request(records))
    assert runs[0] == runs[1]
    assert sorted(runs[1]) == sorted(child_request_ids("r", 3))


def test_an_abort_with_two_steps_in_flight_frees_everything_and_delivers_no_more_tokens():
    scheduler, allocator, worker = make_stack(max_steps_in_flight=2)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=50))
    scheduler.add_request(make_request("b", num_prompt_tokens=6, max_tokens=8))
    planned = deque()
    records = []
    while len(records) < 4:
        record = run_pipelined_step(scheduler, allocator, worker, planned)
        records.append(record) if record is not None else None
    assert len(planned) == 1 and scheduler.num_steps_in_flight == 1
    delivered = len(outputs_by_request(records)["a"])
    assert scheduler.abort_request("a")
    records += run_pipelined_until_done(scheduler, allocator, worker, planned=planned)
    assert len(outputs_by_request(records)["a"]) == delivered
    assert finish_reasons(records) == {"a": "abort", "b": "length"}
    assert allocator.num_free_blocks == allocator.num_blocks and worker.requests == {}


def test_generated_blocks_are_hashed_a_step_late_but_shared():
    """The kvstore learns each token a step after its slot: the blocks still get hashed,
    so a prompt that repeats prompt + output hits them."""
    scheduler, _, _ = make_stack(num_blocks=64, block_size=4, max_steps_in_flight=2)
    manager = BlockManager(64, 4, enable_prefix_caching=True, watermark=0.0)
    worker = FakeWorker(4)
    a = make_request("a", num_prompt_tokens=10, max_tokens=22)
    scheduler.add_request(a)
    run_pipelined_until_done(scheduler, manager, worker)
    manager.check_integrity()
    b = make_request("b", num_prompt_tokens=1, max_tokens=1)
    b.prompt_token_ids = a.prompt_token_ids + a.output_token_ids  # 32 tokens
    scheduler.add_request(b)
    run_pipelined_until_done(scheduler, manager, worker)
    # the last token's K/V is always computed; the first 7 blocks are a's: 28 tokens cached
    assert b.num_cached_tokens == 28
    manager.check_integrity()
    assert manager.num_free_blocks == 64


@pytest.mark.parametrize(("in_flight", "lag"), [(1, 0), (2, 1)])
def test_a_result_waits_only_for_the_tier_writes_of_steps_the_scheduler_no_longer_plans_ahead_of(in_flight, lag):
    scheduler, allocator, worker = make_stack(max_steps_in_flight=in_flight)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=3))
    run = run_pipelined_until_done if in_flight == 2 else run_until_done
    assert {record.plan.stores_lag for record in run(scheduler, allocator, worker)} == {lag}


def test_the_tier_writes_a_result_names_ride_the_next_alloc_request_even_when_nothing_is_left_to_run():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a", num_prompt_tokens=8, max_tokens=1))
    alloc = scheduler.schedule()
    result = worker.execute(scheduler.on_alloc(allocator.step(alloc)))
    result.tier_written = [b"h0", b"h1"]  # the worker wrote both blocks the kvstore reserved
    scheduler.on_result(result)  # a finishes
    assert alloc.tier_written == [] and not scheduler.has_unfinished_requests() and scheduler.has_requests()
    records = run_until_done(scheduler, allocator, worker)
    assert [(r.alloc_request.tier_written, r.alloc_request.free_request_ids) for r in records] == [
        ([b"h0", b"h1"], ["a"])]


def test_with_async_scheduling_a_storing_step_is_followed_by_one_whose_result_names_its_writes():
    scheduler, allocator, worker = make_stack(max_steps_in_flight=2)
    scheduler.add_request(make_request("a", num_prompt_tokens=8, max_tokens=1))
    alloc = scheduler.schedule()
    reply = allocator.step(alloc)
    reply.tier_stores = [("a", 0, b"h0"), ("a", 1, b"h1")]
    plan = scheduler.on_alloc(reply)
    scheduler.on_result(worker.execute(plan))  # a finishes; its result waited for no write of this step
    assert plan.stores_lag == 1 and not scheduler.has_unfinished_requests() and scheduler.has_requests()
    records = run_pipelined_until_done(scheduler, allocator, worker)
    assert [(r.plan.stores_lag, r.plan.num_scheduled_tokens, r.alloc_request.free_request_ids) for r in records] == [
        (1, 0, ["a"])]
