"""stream_interval: a request's tokens reach the api every N tokens, its first and its last
at once, with nothing lost, repeated or reordered (logprobs included)."""

import pytest

from pagedserve.services.scheduler.api_routes import request_from_submit
from pagedserve.shared.messages import SamplingParams, SubmitRequest
from tests.scheduler.fakes import (
    EOS,
    make_request,
    make_stack,
    run_pipelined_until_done,
    run_step,
    run_until_done,
    token_at,
)
from tests.scheduler.outcomes import outputs_by_request


def _delta_sizes(records, request_id: str) -> list[int]:
    return [len(d.new_token_ids) for r in records for d in r.deltas if d.request_id == request_id]


def test_tokens_travel_in_groups_of_the_interval_first_and_last_at_once():
    scheduler, allocator, worker = make_stack(stream_interval=3)
    request = make_request("a", num_prompt_tokens=8, max_tokens=9, ignore_eos=True)
    scheduler.add_request(request)
    records = run_until_done(scheduler, allocator, worker)

    assert _delta_sizes(records, "a") == [1, 3, 3, 2]
    assert outputs_by_request(records) == {"a": [token_at("a", 8 + i) for i in range(9)]}
    assert [d.finish_reason for r in records for d in r.deltas] == [None, None, None, "length"]
    assert [d.num_output_tokens for r in records for d in r.deltas] == [1, 4, 7, 9]


def test_interval_one_sends_every_token_alone():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a", max_tokens=4, ignore_eos=True))
    assert _delta_sizes(run_until_done(scheduler, allocator, worker), "a") == [1, 1, 1, 1]


def test_a_stop_token_flushes_what_was_held():
    def eos_at_fourth(request_id: str, position: int) -> int:
        return EOS if position == 11 else token_at(request_id, position)

    scheduler, allocator, worker = make_stack(stream_interval=8, token_fn=eos_at_fourth)
    scheduler.add_request(make_request("a", num_prompt_tokens=8, max_tokens=50))
    records = run_until_done(scheduler, allocator, worker)

    assert _delta_sizes(records, "a") == [1, 3]
    assert outputs_by_request(records)["a"] == [token_at("a", 8), token_at("a", 9), token_at("a", 10), EOS]
    assert records[-2].deltas[-1].finish_reason == "stop"


def test_logprobs_travel_with_their_tokens():
    scheduler, allocator, worker = make_stack(stream_interval=2)
    scheduler.add_request(make_request("a", max_tokens=5, ignore_eos=True, logprobs=0))
    deltas = [d for r in run_until_done(scheduler, allocator, worker) for d in r.deltas]

    assert [len(d.new_token_ids) for d in deltas] == [1, 2, 2]
    for delta in deltas:
        assert [t.token_id for t in delta.logprobs] == delta.new_token_ids


def test_async_scheduling_keeps_every_token_in_order():
    scheduler, allocator, worker = make_stack(stream_interval=4, max_steps_in_flight=2)
    for request_id, max_tokens in (("a", 10), ("b", 3)):
        scheduler.add_request(make_request(request_id, max_tokens=max_tokens, ignore_eos=True))
    records = run_pipelined_until_done(scheduler, allocator, worker)

    assert outputs_by_request(records) == {rid: [token_at(rid, 8 + i) for i in range(n)]
                                           for rid, n in (("a", 10), ("b", 3))}
    assert _delta_sizes(records, "a") == [1, 4, 4, 1] and _delta_sizes(records, "b") == [1, 2]


def test_an_abort_drops_what_was_held():
    scheduler, allocator, worker = make_stack(stream_interval=4)
    scheduler.add_request(make_request("a", max_tokens=50, ignore_eos=True))
    for _ in range(3):
        run_step(scheduler, allocator, worker)
    scheduler.abort_request("a")
    record = run_step(scheduler, allocator, worker)

    assert [(d.new_token_ids, d.finish_reason) for d in record.deltas] == [([], "abort")]


def test_a_resubmission_streams_only_what_the_api_lacks():
    """The api resends what it was sent; the held tokens of the old scheduler are recomputed."""
    scheduler, allocator, worker = make_stack(stream_interval=3)
    first = make_request("a", max_tokens=6, ignore_eos=True)
    delivered = [token_at("a", 8), token_at("a", 9)]
    sub = SubmitRequest("a", "api-0", first.prompt_token_ids, SamplingParams(max_tokens=6, ignore_eos=True), 0.0,
                        output_token_ids=delivered)
    scheduler.add_request(request_from_submit(sub, [EOS]))
    records = run_until_done(scheduler, allocator, worker)

    assert outputs_by_request(records) == {"a": [token_at("a", 10 + i) for i in range(4)]}
    assert _delta_sizes(records, "a") == [3, 1]


@pytest.mark.parametrize("bad", [0, -1])
def test_interval_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="stream_interval"):
        make_stack(stream_interval=bad)
