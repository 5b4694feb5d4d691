"""Multi-step decoding (multi_step.py): decode-only steps run up to num_scheduler_steps in one plan, within
max_tokens, max_model_len and the token budget; the output is the single-step output, token for token."""

from __future__ import annotations

import pytest

from pagedserve.services.scheduler.multi_step import MAX_PLAN_SECONDS, PlanLength
from pagedserve.services.scheduler.step import InFlightStep, ScheduledRequest
from pagedserve.shared.messages import SampledToken, StepResult
from tests.scheduler.fakes import (
    EOS,
    make_request,
    make_stack,
    run_pipelined_until_done,
    run_step,
    run_until_done,
    token_at,
)


def outputs(records) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for record in records:
        for delta in record.deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                reasons[delta.request_id] = delta.finish_reason
    return tokens, reasons


def steps_planned(records, request_id: str) -> list[int]:
    return [c.num_steps for r in records for c in r.plan.cached_requests if c.request_id == request_id]


def test_decode_steps_run_four_to_a_plan_up_to_max_tokens():
    scheduler, allocator, worker = make_stack(num_scheduler_steps=4)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=10))
    records = run_until_done(scheduler, allocator, worker)
    assert [r.plan.new_requests[0].num_scheduled_tokens for r in records if r.plan.new_requests] == [4]
    assert steps_planned(records, "a") == [4, 4, 1]  # the prefill samples 1; 9 more
    assert [len(r.result.sampled) for r in records] == [1, 4, 4, 1, 0]  # the last step only frees
    tokens, reasons = outputs(records)
    assert tokens == {"a": [token_at("a", p) for p in range(4, 14)]} and reasons == {"a": "length"}
    assert [c.num_new_tokens for r in records for c in r.alloc_request.candidates] == [4, 4, 4, 1]
    assert not allocator.tables
    allocator.check_integrity()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_output_is_the_single_step_output(in_flight):
    def run(num_steps: int):
        scheduler, allocator, worker = make_stack(max_num_seqs=3, num_scheduler_steps=num_steps, block_size=4,
                                                  num_blocks=64, max_steps_in_flight=in_flight)
        for i in range(5):
            scheduler.add_request(make_request(f"r{i}", num_prompt_tokens=3 + i, max_tokens=5 + 3 * i))
        records = (run_pipelined_until_done(scheduler, allocator, worker) if in_flight == 2
                   else run_until_done(scheduler, allocator, worker))
        assert not allocator.tables
        allocator.check_integrity()
        return outputs(records), len(records)

    (single, num_single), (multi, num_multi) = run(1), run(4)
    assert multi == single
    assert num_multi < num_single


def test_a_step_with_a_waiting_candidate_or_a_prefill_runs_once():
    scheduler, allocator, worker = make_stack(max_num_seqs=2, num_scheduler_steps=4)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=20))
    run_step(scheduler, allocator, worker)  # a's prefill
    assert steps_planned([run_step(scheduler, allocator, worker)], "a") == [4]
    scheduler.add_request(make_request("b", num_prompt_tokens=4, max_tokens=20))
    admitting = run_step(scheduler, allocator, worker)
    assert [r.request_id for r in admitting.plan.new_requests] == ["b"]
    assert steps_planned([admitting], "a") == [1]
    assert [c.num_steps for c in run_step(scheduler, allocator, worker).plan.cached_requests] == [4, 4]


def test_the_token_budget_counts_every_step():
    scheduler, allocator, worker = make_stack(max_num_seqs=3, max_num_batched_tokens=8, num_scheduler_steps=4)
    for name in "abc":
        scheduler.add_request(make_request(name, num_prompt_tokens=2, max_tokens=12))
    run_step(scheduler, allocator, worker)  # three prefills of 2
    record = run_step(scheduler, allocator, worker)
    assert [c.num_steps for c in record.plan.cached_requests] == [2, 2, 2]  # 8 // 3
    assert sum(c.num_new_tokens for c in record.alloc_request.candidates) <= 8


def test_max_model_len_bounds_the_steps():
    scheduler, allocator, worker = make_stack(max_model_len=12, num_scheduler_steps=4)
    scheduler.add_request(make_request("a", num_prompt_tokens=6, max_tokens=100))
    records = run_until_done(scheduler, allocator, worker)
    assert steps_planned(records, "a") == [4, 1]  # 6 + 1 + 4 + 1 = 12
    assert outputs(records)[1] == {"a": "length"}


def test_a_stop_inside_the_steps_ends_the_request_there_and_frees_its_slots():
    def eos_at_third_output(request_id: str, position: int) -> int:
        return EOS if position == 4 + 2 else token_at(request_id, position)

    scheduler, allocator, worker = make_stack(num_scheduler_steps=4, token_fn=eos_at_third_output)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=20))
    records = run_until_done(scheduler, allocator, worker)
    tokens, reasons = outputs(records)
    assert tokens == {"a": [token_at("a", 4), token_at("a", 5), EOS]} and reasons == {"a": "stop"}
    assert not allocator.tables
    allocator.check_integrity()


def test_a_result_short_of_the_steps_without_a_stop_is_refused():
    scheduler, allocator, worker = make_stack(num_scheduler_steps=4)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=20))
    run_step(scheduler, allocator, worker)
    plan = scheduler.on_alloc(allocator.step(scheduler.schedule()))
    assert plan.cached_requests[0].num_steps == 4
    with pytest.raises(ValueError, match="without a stop"):
        scheduler.on_result(StepResult(plan.step_id, [SampledToken("a", 7), SampledToken("a", 8)]))


def test_a_result_past_the_steps_is_refused():
    scheduler, allocator, worker = make_stack(num_scheduler_steps=2)
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=20))
    run_step(scheduler, allocator, worker)
    plan = scheduler.on_alloc(allocator.step(scheduler.schedule()))
    with pytest.raises(ValueError, match="samples 3 tokens"):
        scheduler.on_result(StepResult(plan.step_id, [SampledToken("a", 7)] * 3))


def _decode_step(*num_steps: int, num_scheduled: int = 1) -> InFlightStep:
    request = make_request("a")
    return InFlightStep(0, [ScheduledRequest(request, num_scheduled, samples=True, completes=True, num_steps=n)
                            for n in num_steps])


def test_a_plan_takes_fewer_steps_where_decode_steps_are_slow():
    length = PlanLength(8)
    assert length.steps() == 8  # nothing measured yet
    length.observe(_decode_step(4, 2), 4 * 0.010)  # 10 ms a step
    assert length.step_seconds == pytest.approx(0.010) and length.steps() == 8
    length.observe(_decode_step(1, num_scheduled=300), 3.0)  # a prefill chunk: not a decode step's time
    length.observe(_decode_step(1), 0.0)  # not measured
    assert length.step_seconds == pytest.approx(0.010)
    for _ in range(40):
        length.observe(_decode_step(1, 1), MAX_PLAN_SECONDS / 2.5)
    assert length.steps() == 2
    for _ in range(40):
        length.observe(_decode_step(1), 1.0)
    assert length.steps() == 1


def test_slow_decode_steps_plan_one_step_at_a_time():
    scheduler, allocator, worker = make_stack(num_scheduler_steps=4)
    scheduler.plan_length.step_seconds = MAX_PLAN_SECONDS  # as if measured
    scheduler.add_request(make_request("a", num_prompt_tokens=4, max_tokens=6))
    records = run_until_done(scheduler, allocator, worker)
    assert steps_planned(records, "a") == [1] * 5
