"""The draft cost model's choices on synthetic step costs: exact lengths, none where drafts cannot pay."""

from __future__ import annotations

import pytest

from pagedserve.services.scheduler.draft_cost import Acceptance, choose_lengths, draft_threshold, step_cost
from pagedserve.shared.speculative_config import DEFAULT_STEP_COSTS

COSTS = ((1, 1.0), (2, 1.5), (4, 2.0), (8, 4.0))  # made up: cheap rows up to 4, dear ones to 8, then linear


def test_step_cost_interpolates_and_grows_in_proportion_past_the_table():
    assert [step_cost(COSTS, n) for n in (1, 2, 3, 4, 6, 8, 16)] == [1.0, 1.5, 1.75, 2.0, 3.0, 4.0, 8.0]
    assert step_cost(((2, 3.0), (4, 5.0)), 1) == 3.0  # before the table: its first point


@pytest.mark.parametrize(("rate", "length"), [(0.0, 0), (0.3, 0), (0.55, 2), (0.7, 3), (0.9, 3), (1.0, 3)])
def test_a_lone_request_drafts_more_the_more_it_is_accepted(rate, length):
    """Even always accepted, 7 drafts (8 tokens for 4.0) only tie 3 (4 for 2.0): the fewer win."""
    assert choose_lengths(COSTS, 1, 1, [(rate, 8)]) == [length]


def test_no_longer_than_the_drafts_found():
    assert choose_lengths(COSTS, 1, 1, [(1.0, 2)]) == [2]
    assert choose_lengths(COSTS, 1, 1, [(1.0, 0)]) == [0]
    assert choose_lengths(COSTS, 1, 1, []) == []


def test_in_a_batch_the_better_accepted_requests_draft_first():
    assert choose_lengths(COSTS, 2, 2, [(0.5, 4), (0.9, 4), (0.2, 4)]) == [0, 2, 0]


def test_where_step_time_is_linear_in_tokens_nothing_pays():
    linear = ((1, 1.0), (2, 2.0))
    assert choose_lengths(linear, 1, 1, [(0.99, 8)]) == [0]
    assert choose_lengths(linear, 3, 3, [(0.99, 8)] * 3) == [0, 0, 0]


def test_default_table_turns_drafts_off_at_64_decodes_and_on_alone():
    offers = [(0.5, 4)] * 64
    assert choose_lengths(DEFAULT_STEP_COSTS, 64, 64, offers) == [0] * 64
    assert choose_lengths(DEFAULT_STEP_COSTS, 64, 64, [(0.8, 4)] * 64) == [0] * 64
    assert choose_lengths(DEFAULT_STEP_COSTS, 1, 1, [(0.5, 8)]) == [2]
    assert choose_lengths(DEFAULT_STEP_COSTS, 1, 1, [(0.8, 8)]) == [4]
    assert choose_lengths(DEFAULT_STEP_COSTS, 1, 1, [(0.95, 16)]) == [7]  # 9 rows leave the few-row kernel


def test_a_prefill_heavy_step_takes_drafts_nearly_free():
    costs = ((1, 1.0), (256, 100.0), (512, 120.0))
    assert choose_lengths(costs, 256, 2, [(0.3, 4)]) == [4]  # a prefill chunk and a decode
    assert choose_lengths(costs, 256, 256, [(0.3, 4)]) == [0]  # 256 decodes


@pytest.mark.parametrize(("num_tokens", "num_sampled"), [(1, 1), (2, 2), (7, 1), (16, 16), (64, 64), (256, 2)])
@pytest.mark.parametrize("most", [1, 4, 7])
def test_the_draft_threshold_is_where_choose_lengths_starts_drafting(num_tokens, num_sampled, most):
    threshold = draft_threshold(DEFAULT_STEP_COSTS, num_tokens, num_sampled, most)
    for rate, drafts in ((threshold - 1e-9, False), (threshold + 1e-9, True)):
        if 0 <= rate <= 1:
            assert bool(choose_lengths(DEFAULT_STEP_COSTS, num_tokens, num_sampled, [(rate, most)])[0]) is drafts
    assert draft_threshold(DEFAULT_STEP_COSTS, 64, 64, most) > 0.9


def test_past_a_cliff_a_long_draft_pays_where_one_does_not():
    costs = ((1, 1.0), (2, 1.9), (4, 2.55), (8, 3.83), (9, 5.05))
    assert draft_threshold(costs, 1, 1) == pytest.approx(0.938)
    threshold = draft_threshold(costs, 1, 1, 7)
    assert 0.71 < threshold < 0.72
    assert choose_lengths(costs, 1, 1, [(threshold + 1e-9, 7)]) == [3]
    assert choose_lengths(costs, 1, 1, [(threshold - 1e-9, 7)]) == [0]


def test_acceptance_counts_fade_toward_the_prior():
    acceptance = Acceptance()
    assert acceptance.rate(0.5) == 0.5
    acceptance.add(4, 4)  # all accepted: no rejection
    acceptance.add(4, 1)
    assert (acceptance.accepted, acceptance.rejected) == (5.0, 1.0)
    assert acceptance.rate(0.5) == pytest.approx(6 / 8)
    acceptance.fade(0.5)
    assert (acceptance.accepted, acceptance.rejected) == (2.5, 0.5)
    assert acceptance.rate(0.5) == pytest.approx(3.5 / 5)
