"""Preemption: a running request the kvstore sacrifices recomputes later, same tokens."""

import pytest

from pagedserve.services.scheduler.policy import SchedulingPolicy
from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.shared.messages import ALLOC_PREEMPTED
from tests.scheduler.fakes import CountingAllocator, FakeWorker, make_request, make_stack, run_step, run_until_done
from tests.scheduler.outcomes import finish_reasons, outputs_by_request


class AsQueuedPolicy(SchedulingPolicy):
    """Keeps the scheduler's own queue order, so the queue itself can be observed."""

    name = "as-queued"

    def order_waiting(self, waiting: list[Request], running: list[Request]) -> list[Request]:
        return list(waiting)

    def order_running(self, running: list[Request]) -> list[Request]:
        return list(running)


def _two_requests() -> list[Request]:
    # each ends at 20 tokens = 5 blocks of 4; a 7-block pool cannot hold both
    return [
        make_request("a", num_prompt_tokens=8, max_tokens=12, arrival_time=0.0),
        make_request("b", num_prompt_tokens=8, max_tokens=12, arrival_time=1.0),
    ]


def _step_until_preemption(scheduler, allocator, worker):
    records = []
    while True:
        records.append(run_step(scheduler, allocator, worker))
        if any(r.status == ALLOC_PREEMPTED for r in records[-1].alloc_reply.results):
            return records


def test_the_least_important_running_request_is_preempted_and_recomputed():
    scheduler, allocator, worker = make_stack(num_blocks=7, block_size=4)
    a, b = _two_requests()
    scheduler.add_request(a)
    scheduler.add_request(b)
    records = _step_until_preemption(scheduler, allocator, worker)

    preempting = records[-1]
    assert len(records) == 6  # slots 8 (2 blocks), 9 (3 blocks) .. 13 (4 blocks: dry)
    assert [c.request_id for c in preempting.alloc_request.candidates] == ["a", "b"]
    assert preempting.scheduled_tokens() == {"a": 1}
    assert preempting.plan.finished_request_ids == ["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == outputs_by_request(records)["b"] and len(b.output_token_ids) == 5
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    assert worker.requests.keys() == {"a"}

    rest = run_until_done(scheduler, allocator, worker)
    resumed = next(r for r in rest if r.plan.new_requests)
    assert [n.request_id for n in resumed.plan.new_requests] == ["b"]
    assert resumed.plan.new_requests[0].token_ids == b.prompt_token_ids + outputs_by_request(records)["b"]
    assert resumed.plan.new_requests[0].num_computed_tokens == 0
    assert scheduler.stats().num_preemptions_total == 1

    reference_scheduler, reference_allocator, reference_worker = make_stack(num_blocks=64)
    for request in _two_requests():
        reference_scheduler.add_request(request)
    reference = run_until_done(reference_scheduler, reference_allocator, reference_worker)
    preempted_run = records + rest
    assert outputs_by_request(preempted_run) == outputs_by_request(reference)
    assert finish_reasons(preempted_run) == finish_reasons(reference) == {"a": "length", "b": "length"}
    assert allocator.tables == {} and worker.requests == {}


def test_a_preempted_request_goes_back_to_the_front_of_waiting():
    scheduler = Scheduler(AsQueuedPolicy(), max_num_seqs=2, max_num_batched_tokens=32, num_scheduler_steps=1)
    allocator, worker = CountingAllocator(num_blocks=7, block_size=4), FakeWorker(block_size=4)
    for request in _two_requests() + [make_request("c", num_prompt_tokens=8, arrival_time=2.0)]:
        scheduler.add_request(request)
    preempting = _step_until_preemption(scheduler, allocator, worker)[-1]
    assert [c.request_id for c in preempting.alloc_request.candidates] == ["a", "b"]

    after = run_step(scheduler, allocator, worker)
    offered = [(c.request_id, c.is_waiting) for c in after.alloc_request.candidates]
    assert offered == [("a", False), ("b", True)]


def test_a_preempted_request_is_not_offered_again_in_the_same_step():
    scheduler, allocator, worker = make_stack(num_blocks=7, block_size=4)
    for request in _two_requests():
        scheduler.add_request(request)
    records = _step_until_preemption(scheduler, allocator, worker)
    waiting_offers = [c.request_id for c in records[-1].alloc_request.candidates if c.is_waiting]
    assert waiting_offers == []
    assert [n.request_id for n in records[-1].plan.new_requests] == []


def test_preempt_all_abandons_the_open_step_and_requeues_every_running_request():
    def requests():
        return [make_request(r, num_prompt_tokens=8, max_tokens=5, arrival_time=t) for r, t in (("a", 0), ("b", 1))]

    scheduler, allocator, worker = make_stack()
    a, b = requests()
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = run_step(scheduler, allocator, worker)
    scheduler.on_alloc(allocator.step(scheduler.schedule()))  # the worker dies with this step

    assert scheduler.preempt_all() == [a, b]
    preempted = (RequestStatus.PREEMPTED, 0, 1)
    assert [(r.status, r.num_computed_tokens, r.num_preemptions) for r in (a, b)] == [preempted, preempted]
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 2)
    scheduler.start_step_ids_at(100)
    allocator, worker = CountingAllocator(num_blocks=256, block_size=4), FakeWorker(block_size=4)  # both reset
    rest = run_until_done(scheduler, allocator, worker)

    assert rest[0].alloc_request.step_id == 100
    assert [(c.request_id, c.is_waiting, c.token_ids) for c in rest[0].alloc_request.candidates] == [
        ("a", True, a.prompt_token_ids + outputs_by_request([first])["a"]),
        ("b", True, b.prompt_token_ids + outputs_by_request([first])["b"]),
    ]
    reference_scheduler, reference_allocator, reference_worker = make_stack()
    for request in requests():
        reference_scheduler.add_request(request)
    reference = run_until_done(reference_scheduler, reference_allocator, reference_worker)
    assert outputs_by_request([first] + rest) == outputs_by_request(reference)
    assert scheduler.stats().num_preemptions_total == 2


def test_step_ids_change_only_between_steps():
    scheduler, _, _ = make_stack()
    scheduler.start_step_ids_at(7)
    assert scheduler.schedule().step_id == 7
    with pytest.raises(RuntimeError):
        scheduler.start_step_ids_at(9)
    scheduler.preempt_all()  # abandons the open step
    scheduler.start_step_ids_at(9)
    assert scheduler.schedule().step_id == 9
