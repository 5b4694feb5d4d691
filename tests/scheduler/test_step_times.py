"""The learned step-cost table: exact points from measured steps, the prior where none were seen."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.services.scheduler.draft_cost import choose_lengths
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.services.scheduler.step_times import (
    EXACT_TOKENS,
    MIN_SAMPLES,
    REBUILD_EVERY,
    WINDOW,
    StepTimes,
    bucket_of,
)
from pagedserve.shared.speculative_config import SpeculativeConfig
from tests.scheduler.fakes import CountingAllocator, FakeWorker, make_request, run_until_done

PRIOR = ((1, 1.0), (2, 1.5), (8, 3.0), (64, 10.0))


def test_buckets_are_exact_then_powers_of_two():
    assert [bucket_of(n) for n in (1, 9, EXACT_TOKENS, 17, 32, 33, 100)] == [1, 9, 16, 32, 32, 64, 128]


def test_the_prior_until_a_bucket_has_enough_steps():
    times = StepTimes(PRIOR)
    for _ in range(MIN_SAMPLES - 1):
        times.observe(1, 0.010)
    assert times.rebuild() == PRIOR


def test_measured_buckets_replace_the_prior_in_its_units():
    times = StepTimes(PRIOR)
    for _ in range(MIN_SAMPLES):
        times.observe(1, 0.010)  # 10 ms = the prior's 1.0: the scale
        times.observe(2, 0.012)
        times.observe(5, 0.030)
    table = times.rebuild()
    # scale: median of 0.010/1.0, 0.012/1.5, 0.030/2.25 (prior at 5) = 0.010, 0.008, 0.0133 -> 0.010
    assert [n for n, _ in table] == [1, 2, 5, 8, 64]
    assert [c for _, c in table] == pytest.approx([1.0, 1.2, 3.0, 3.0, 10.0])


def test_a_longer_step_never_costs_less():
    times = StepTimes(PRIOR)
    for _ in range(MIN_SAMPLES):
        times.observe(1, 0.010)
        times.observe(8, 0.050)
        times.observe(9, 0.020)  # noise: cheaper than 8 tokens
    costs = [cost for _, cost in times.rebuild()]
    assert costs == sorted(costs)


def test_the_table_follows_the_machine_and_drafting_follows_the_table():
    """Where verifying is nearly free a lone request drafts long; the steep prior allowed none."""
    steep = ((1, 1.0), (2, 2.0), (4, 4.0), (8, 8.0))
    times = StepTimes(steep)
    assert choose_lengths(times.table(), 1, 1, [(0.8, 7)]) == [0]
    for i in range(REBUILD_EVERY):
        times.observe(1 + i % 8, 0.010 + 0.0005 * (i % 8))
    assert choose_lengths(times.table(), 1, 1, [(0.8, 7)]) == [7]


def test_one_slow_step_does_not_price_out_longer_steps():
    times = StepTimes(PRIOR)
    times.observe(4, 0.300)  # the warm-up request's 4-token prefill
    for _ in range(MIN_SAMPLES):
        times.observe(1, 0.010)
        times.observe(4, 0.012)
        times.observe(7, 0.015)
    table = times.rebuild()
    assert dict(table)[4] == pytest.approx(dict(table)[1] * 1.2)
    assert choose_lengths(table, 1, 1, [(0.8, 5)]) == [5]


def test_a_bucket_follows_its_last_steps():
    times = StepTimes(PRIOR)
    for seconds in [0.050] * WINDOW + [0.010] * (WINDOW // 2 + 1):
        times.observe(1, seconds)
    assert times._buckets[1].point() == pytest.approx((1, 0.010))


def test_unmeasured_steps_are_ignored():
    times = StepTimes(PRIOR)
    for _ in range(REBUILD_EVERY):
        times.observe(4, 0.0)
        times.observe(0, 0.01)
    assert times.rebuild() == PRIOR


@given(st.lists(st.tuples(st.integers(1, 300), st.floats(1e-4, 1.0)), max_size=200))
def test_the_table_is_increasing_in_tokens_and_positive(steps):
    times = StepTimes(PRIOR)
    for num_tokens, seconds in steps:
        times.observe(num_tokens, seconds)
    table = times.rebuild()
    tokens = [n for n, _ in table]
    assert tokens == sorted(set(tokens)) and all(cost > 0 for _, cost in table)
    assert [c for _, c in table] == sorted(c for _, c in table)


def test_the_scheduler_feeds_each_results_step_time_to_the_table():
    class TimedWorker(FakeWorker):
        def execute(self, plan):
            result = super().execute(plan)
            num_tokens = sum(r.num_scheduled_tokens for r in plan.new_requests + plan.cached_requests)
            result.step_seconds = 0.001 * num_tokens
            return result

    scheduler = Scheduler(FCFSPolicy(), 8, 32, 1024, speculative_config=SpeculativeConfig("ngram", 3, 1, 3))
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=5))
    run_until_done(scheduler, CountingAllocator(64, 4), TimedWorker(4))
    buckets = scheduler._speculator.step_times._buckets
    assert {key: b.count for key, b in buckets.items()} == {10: 1, 1: 4}
    assert buckets[1].point() == pytest.approx((1, 0.001))
