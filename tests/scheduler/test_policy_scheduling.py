"""Policies driving the real scheduler core (fake kvstore and worker): displacement at the
running limit without ping-pong, starvation freedom, fair share under a flood, and
swapping the policy between steps under load."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.scheduler.policies.fair import FairPolicy
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.policies.priority import PriorityPolicy
from pagedserve.services.scheduler.policies.sjf import SJFPolicy
from pagedserve.services.scheduler.scheduler import Scheduler
from tests.scheduler.fakes import CountingAllocator, FakeWorker, make_request, run_step, run_until_done, token_at
from tests.scheduler.outcomes import finish_reasons, outputs_by_request


def _stack(policy, max_num_seqs=2, max_num_batched_tokens=64, num_blocks=256):
    scheduler = Scheduler(policy, max_num_seqs, max_num_batched_tokens, max_model_len=1024, num_scheduler_steps=1)
    return scheduler, CountingAllocator(num_blocks, 4), FakeWorker(4)


def _add(scheduler, request_id, arrival, priority=0, tenant=None, num_prompt_tokens=8, max_tokens=4):
    request = make_request(request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
                           arrival_time=arrival)
    request.priority, request.tenant = priority, tenant
    scheduler.add_request(request)
    return request


def _expected_output(request_id: str, num_prompt_tokens: int, max_tokens: int) -> list[int]:
    return [token_at(request_id, num_prompt_tokens + i) for i in range(max_tokens)]


def _first_token_step(records, request_id: str) -> int:
    return next(i for i, r in enumerate(records) if any(d.request_id == request_id and d.new_token_ids
                                                        for d in r.deltas))


def test_a_high_priority_arrival_displaces_the_latest_low_priority_request_at_the_running_limit():
    scheduler, allocator, worker = _stack(PriorityPolicy(), max_num_seqs=2)
    _add(scheduler, "low0", 0.0, max_tokens=8)
    _add(scheduler, "low1", 1.0, max_tokens=8)
    records = [run_step(scheduler, allocator, worker)]
    assert scheduler.num_running == 2
    _add(scheduler, "high", 2.0, priority=5, max_tokens=3)
    _add(scheduler, "low2", 3.0, max_tokens=2)  # equal priority to the running ones: waits
    records.append(run_step(scheduler, allocator, worker))
    step = records[-1]
    # high stands before the running ones it may displace; the kvstore takes the tail for its seat
    assert [c.request_id for c in step.alloc_request.candidates] == ["high", "low0", "low1"]
    assert step.alloc_request.num_free_seqs == 0
    assert [(r.request_id, r.status) for r in step.alloc_reply.results] == [
        ("high", "ok"), ("low0", "ok"), ("low1", "preempted")]
    assert step.plan.finished_request_ids == ["low1"]
    records += run_until_done(scheduler, allocator, worker)
    assert scheduler.stats().num_preemptions_total == 1  # no ping-pong afterwards
    outputs = outputs_by_request(records)
    for request_id, max_tokens in (("low0", 8), ("low1", 8), ("high", 3), ("low2", 2)):
        assert outputs[request_id] == _expected_output(request_id, 8, max_tokens)
    assert finish_reasons(records) == {"low0": "length", "low1": "length", "high": "length", "low2": "length"}
    allocator.check_integrity()
    assert allocator.num_free_blocks == allocator.num_blocks


def test_equal_priorities_never_displace_each_other():
    scheduler, allocator, worker = _stack(PriorityPolicy(), max_num_seqs=1)
    for i in range(4):
        _add(scheduler, f"r{i}", float(i), priority=3)
    run_until_done(scheduler, allocator, worker)
    assert scheduler.stats().num_preemptions_total == 0


def test_a_dry_pool_lets_a_higher_priority_request_displace_in_the_same_step():
    # 12 blocks of 4: two running 20-token prompts hold 10; a 12-token prompt does not fit
    scheduler, allocator, worker = _stack(PriorityPolicy(), max_num_seqs=4, num_blocks=12)
    _add(scheduler, "low0", 0.0, num_prompt_tokens=20, max_tokens=4)
    _add(scheduler, "low1", 1.0, num_prompt_tokens=20, max_tokens=4)
    run_step(scheduler, allocator, worker)
    _add(scheduler, "high", 2.0, priority=1, num_prompt_tokens=12, max_tokens=4)
    displacing = run_step(scheduler, allocator, worker)
    assert [(r.request_id, r.status) for r in displacing.alloc_reply.results] == [
        ("high", "ok"), ("low0", "ok"), ("low1", "preempted")]
    assert displacing.scheduled_tokens()["high"] == 12
    records = [displacing, *run_until_done(scheduler, allocator, worker)]
    assert finish_reasons(records) == {"high": "length", "low0": "length", "low1": "length"}
    assert outputs_by_request(records)["high"] == _expected_output("high", 12, 4)
    allocator.check_integrity()


def test_sjf_aging_runs_a_long_request_despite_a_stream_of_short_ones():
    def run(aging: float) -> int | None:
        scheduler, allocator, worker = _stack(SJFPolicy(aging=aging), max_num_seqs=1)
        _add(scheduler, "long", 0.0, num_prompt_tokens=40, max_tokens=20)  # work 60
        for step in range(200):
            if scheduler.num_waiting < 3:  # a short request (work 8) always waits beside it
                _add(scheduler, f"short{step}", 1.0 + step, num_prompt_tokens=4, max_tokens=4)
            record = run_step(scheduler, allocator, worker)
            if "long" in record.scheduled_tokens():
                return step
        return None

    assert run(aging=0.0) is None  # without aging the long request starves
    started = run(aging=1.0)
    assert started is not None and started <= 60  # its key falls below 8 within 52 steps waited


def test_fair_share_a_flooding_tenant_cannot_starve_another():
    def first_token_wait(policy) -> int:
        scheduler, allocator, worker = _stack(policy, max_num_seqs=4)
        for i in range(40):
            _add(scheduler, f"a{i}", float(i), tenant="A", max_tokens=8)
        records = [run_step(scheduler, allocator, worker) for _ in range(3)]
        _add(scheduler, "b", 100.0, tenant="B", max_tokens=8)
        records += run_until_done(scheduler, allocator, worker)
        assert finish_reasons(records) == {**{f"a{i}": "length" for i in range(40)}, "b": "length"}
        assert outputs_by_request(records)["b"] == _expected_output("b", 8, 8)
        return _first_token_step(records, "b") - 3

    assert first_token_wait(FairPolicy()) == 0  # displaces A's latest at once
    assert first_token_wait(FCFSPolicy()) > 50  # behind every A


def test_fair_share_of_slots_between_two_flooding_tenants():
    scheduler, allocator, worker = _stack(FairPolicy(), max_num_seqs=4)
    for i in range(20):
        _add(scheduler, f"a{i}", float(i), tenant="A", max_tokens=30)
    for i in range(20):
        _add(scheduler, f"b{i}", 100.0 + i, tenant="B", max_tokens=30)
    for _ in range(5):
        run_step(scheduler, allocator, worker)
        tenants = [r.tenant for r in scheduler._running]
        assert sorted(tenants) == ["A", "A", "B", "B"]


POLICIES = st.sampled_from([FCFSPolicy, PriorityPolicy, SJFPolicy, FairPolicy])


@settings(max_examples=25, deadline=None)
@given(swaps=st.lists(st.tuples(st.integers(0, 40), POLICIES), max_size=6),
       priorities=st.lists(st.integers(0, 2), min_size=12, max_size=12),
       max_num_seqs=st.integers(1, 5), num_blocks=st.integers(12, 64))
def test_swapping_the_policy_between_steps_under_load_completes_every_request_exactly(
        swaps, priorities, max_num_seqs, num_blocks):
    scheduler, allocator, worker = _stack(FCFSPolicy(), max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
                                          num_blocks=num_blocks)
    for i, priority in enumerate(priorities):
        _add(scheduler, f"r{i}", float(i), priority=priority, tenant="AB"[i % 2], num_prompt_tokens=6 + i % 5,
             max_tokens=3 + i % 4)
    swap_at = dict(swaps)
    records = []
    while scheduler.has_requests():
        assert len(records) < 2000, "no progress"
        if len(records) in swap_at:
            scheduler.set_policy(swap_at[len(records)]())
        records.append(run_step(scheduler, allocator, worker))
        allocator.check_integrity()
    outputs = outputs_by_request(records)
    for i in range(12):
        assert outputs[f"r{i}"] == _expected_output(f"r{i}", 6 + i % 5, 3 + i % 4)
    assert set(finish_reasons(records).values()) == {"length"}
    assert allocator.num_free_blocks == allocator.num_blocks


def test_the_policy_cannot_change_while_a_step_is_open():
    scheduler, allocator, _worker = _stack(FCFSPolicy())
    _add(scheduler, "a", 0.0)
    scheduler.schedule()
    try:
        scheduler.set_policy(FairPolicy())
    except RuntimeError as e:
        assert "between steps" in str(e)
    else:
        raise AssertionError("set_policy accepted a swap inside a step")
