"""The worker's check of a plan's drafts (gpu_worker/loop.py drop_bad_requests): drafts must be
vocabulary ids right after the request's last known token; a bad one ends that request only."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.services.gpu_worker.loop import drop_bad_requests
from pagedserve.shared.messages import CachedRequestData, StepPlan


def _worker():
    state = SimpleNamespace(token_ids=[5, 6, 7, 8], block_ids=[0, 1])
    return SimpleNamespace(requests={"r": state}, model_config=SimpleNamespace(vocab_size=100), num_blocks=4,
                           block_size=4)


def _plan(computed: int, scheduled: int, drafts: list[int]) -> StepPlan:
    return StepPlan(1, cached_requests=[CachedRequestData("r", [], computed, scheduled, drafts)])


def test_drafts_after_the_last_token_pass():
    plan = _plan(3, 4, [9, 10, 11])
    assert drop_bad_requests(plan, _worker()) == [] and len(plan.cached_requests) == 1


def test_drafts_out_of_the_vocabulary_or_not_after_the_last_token_end_the_request():
    assert drop_bad_requests(_plan(3, 3, [9, 100]), _worker()) == [("r", "draft token id out of range")]
    assert drop_bad_requests(_plan(2, 3, [9, 10]), _worker()) == [("r", "drafts not right after its last token")]
    assert drop_bad_requests(_plan(4, 2, [9, 10]), _worker()) == [("r", "drafts not right after its last token")]
    assert drop_bad_requests(_plan(3, 6, [9, 10, 11, 12, 13]), _worker()) == [("r", "too few blocks")]
