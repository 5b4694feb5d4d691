"""The scheduler refuses what breaks its contract instead of corrupting its state."""

import pytest

from pagedserve.services.scheduler.request import Request
from pagedserve.shared.messages import ALLOC_OK, AllocReply, AllocResult, SampledToken, SamplingParams, StepResult
from tests.scheduler.fakes import make_request, make_stack


def test_phases_must_come_in_order():
    scheduler, allocator, worker = make_stack()
    with pytest.raises(RuntimeError):
        scheduler.on_alloc(AllocReply(0))
    with pytest.raises(RuntimeError):
        scheduler.on_result(StepResult(0))
    alloc_request = scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.on_alloc(AllocReply(alloc_request.step_id + 1))
    plan = scheduler.on_alloc(allocator.step(alloc_request))
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    assert scheduler.on_result(worker.execute(plan)) == []
    assert scheduler.schedule().step_id == 1


def test_a_reply_must_answer_exactly_the_candidates():
    scheduler, _, _ = make_stack()
    scheduler.add_request(make_request("a"))
    alloc_request = scheduler.schedule()
    with pytest.raises(ValueError, match="exactly the candidates"):
        scheduler.on_alloc(AllocReply(alloc_request.step_id, [AllocResult("x", ALLOC_OK)]))


def test_a_result_must_sample_exactly_where_the_plan_reaches_the_end():
    scheduler, allocator, _ = make_stack(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", num_prompt_tokens=8))
    plan = scheduler.on_alloc(allocator.step(scheduler.schedule()))
    with pytest.raises(ValueError, match="disagree"):  # a 4-token chunk of 8 samples nothing
        scheduler.on_result(StepResult(plan.step_id, [SampledToken("a", 1)]))
    with pytest.raises(ValueError, match="samples 2 tokens"):
        scheduler.on_result(StepResult(plan.step_id, [SampledToken("a", 1)] * 2))
    with pytest.raises(ValueError, match="not scheduled"):
        scheduler.on_result(StepResult(plan.step_id, [SampledToken("x", 1)]))
    assert scheduler.on_result(StepResult(plan.step_id)) == []


@pytest.mark.parametrize(
    "request_factory, message",
    [
        (lambda: make_request("a", num_prompt_tokens=0), "prompt"),
        (lambda: make_request("a", num_prompt_tokens=16), "prompt"),
        (lambda: make_request("a", max_tokens=0), "max_tokens"),
        (lambda: Request("a", [1], SamplingParams(n=0), [], 0.0), "n must be >= 1"),
    ],
)
def test_add_request_refuses_what_cannot_run(request_factory, message):
    scheduler, _, _ = make_stack(max_model_len=16)
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(request_factory())
    assert not scheduler.has_requests()


def test_add_request_refuses_a_live_duplicate_id():
    scheduler, _, _ = make_stack()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add_request(make_request("a"))
    assert scheduler.num_waiting == 1
