"""The worker's check of a multi-step request (gpu_worker/loop.py drop_bad_requests): one decode token,
no drafts, slots for every step; a bad one ends that request only."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.services.gpu_worker.loop import drop_bad_requests
from pagedserve.shared.messages import CachedRequestData, StepPlan


def _worker():
    state = SimpleNamespace(token_ids=[5, 6, 7, 8], block_ids=[0, 1])
    return SimpleNamespace(requests={"r": state}, model_config=SimpleNamespace(vocab_size=100), num_blocks=4,
                           block_size=4)


def _plan(computed: int, scheduled: int, num_steps: int, drafts: list[int] = (), new_blocks: list[int] = ()):
    return StepPlan(1, cached_requests=[CachedRequestData("r", list(new_blocks), computed, scheduled, list(drafts),
                                                          num_steps)])


def test_a_decode_with_slots_for_every_step_passes():
    plan = _plan(3, 1, 5)  # slots 3..7: the table's 8
    assert drop_bad_requests(plan, _worker()) == [] and len(plan.cached_requests) == 1
    assert drop_bad_requests(_plan(3, 1, 9, new_blocks=[2]), _worker()) == []


def test_too_few_slots_a_bad_count_or_more_than_one_decode_token_end_the_request():
    assert drop_bad_requests(_plan(3, 1, 6), _worker()) == [("r", "too few blocks")]
    assert drop_bad_requests(_plan(3, 1, 0), _worker()) == [("r", "num_steps=0")]
    assert drop_bad_requests(_plan(3, 1, 2, drafts=[9]), _worker()) == [("r", "multi-step but not one decode token")]
    assert drop_bad_requests(_plan(2, 2, 2), _worker()) == [("r", "multi-step but not one decode token")]
    assert drop_bad_requests(_plan(2, 1, 2), _worker()) == [("r", "multi-step but not one decode token")]
