"""The api's table of live requests (services/api/live_table.py), without Redis: deltas become
outputs, finishes retire, late deltas of an ended sequence are dropped, stop strings and bad
deltas come back as aborts to send, and an adopted request is replayed from its events."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.services.api.live_table import LiveTable, record_id_of
from pagedserve.services.api.metrics import ApiMetrics
from pagedserve.services.api.request import ApiRequest
from pagedserve.shared.messages import DeltaBatch, RequestDelta, SamplingParams, SubmitRequest
from tests.api.inprocess import tokenizer, tokens

ENDED: list[tuple[str, str, str]] = []


@pytest.fixture(autouse=True)
def _loop():
    asyncio.set_event_loop(asyncio.new_event_loop())  # a Generation's queue wants one
    ENDED.clear()
    yield
    asyncio.get_event_loop().close()


def opened(request_id: str = "cmpl-a", n: int = 1, stop: list[str] | None = None) -> ApiRequest:
    request = ApiRequest("completion", "smollm2", request_id, [1, 2, 3], SamplingParams(max_tokens=8, n=n),
                         stop or [])
    return request.open("api-1", tokenizer(), ApiMetrics(), lambda gen, finish, why: ENDED.append(
        (gen.sequence_id, finish, why)))


def delta(sequence_id: str, new: list[int], total: int, finish: str | None = None) -> RequestDelta:
    return RequestDelta(sequence_id, new, finish, num_prompt_tokens=3, num_output_tokens=total)


def test_deltas_become_outputs_and_a_finish_retires_the_request():
    table, request = LiveTable(), opened()
    table.add(request)
    first, rest = tokens()[:3], tokens()[3:5]
    outputs, aborts = table.apply(DeltaBatch(1, [delta("cmpl-a", first, 3)]))
    assert [(gen.sequence_id, out.token_ids, out.finish_reason) for gen, out in outputs] == [("cmpl-a", first, None)]
    assert aborts == [] and table.is_live("cmpl-a") and table.request("cmpl-a") is request
    outputs, _ = table.apply(DeltaBatch(2, [delta("cmpl-a", rest, 5, "length")]))
    assert [(out.token_ids, out.finish_reason) for _, out in outputs] == [(rest, "length")]
    assert not table.is_live("cmpl-a") and table.request("cmpl-a") is None and table.knows("cmpl-a")
    assert table.apply(DeltaBatch(3, [delta("cmpl-a", [7], 6)])) == ([], [])  # late: dropped
    assert request.gens[0].token_ids == first + rest


def test_a_request_stays_until_every_sequence_ends():
    table, request = LiveTable(), opened(n=2)
    table.add(request)
    assert [gen.sequence_id for gen in table.sequences()] == ["cmpl-a.0", "cmpl-a.1"]
    table.apply(DeltaBatch(1, [delta("cmpl-a.0", tokens()[:1], 1, "length")]))
    assert table.request("cmpl-a") is request and [g.sequence_id for g in table.sequences()] == ["cmpl-a.1"]
    table.apply(DeltaBatch(2, [delta("cmpl-a.1", tokens()[:1], 1, "length")]))
    assert table.request("cmpl-a") is None and table.requests() == []


def test_unknown_lists_each_sequence_neither_live_nor_ended_once_in_order():
    table = LiveTable()
    table.add(opened("cmpl-live"))
    table.forget("cmpl-gone")
    batch = DeltaBatch(1, [delta(s, [5], 1) for s in ("x.1", "cmpl-live", "x.0", "cmpl-gone", "x.1")])
    assert table.unknown(batch) == ["x.1", "x.0"]
    assert [record_id_of(s) for s in ("x.1", "cmpl-a")] == ["x", "cmpl-a"]


def test_a_stop_string_and_a_bad_delta_come_back_as_aborts_to_send():
    text_ids = tokenizer().encode(" red, green")
    table, stopped, broken = LiveTable(), opened("cmpl-s", stop=[","]), opened("cmpl-b")
    table.add(stopped)
    table.add(broken)
    outputs, aborts = table.apply(DeltaBatch(1, [
        delta("cmpl-s", text_ids, len(text_ids)),
        delta("cmpl-b", [tokenizer().vocab_size], 1),  # out of the vocabulary
    ]))
    assert [(gen.sequence_id, out.finish_reason) for gen, out in outputs] == [("cmpl-s", "stop"), ("cmpl-b", "error")]
    assert outputs[0][1].text == " red"
    assert aborts == [("cmpl-s", "stop string"), ("cmpl-b", "bad token id on the wire")]
    assert table.sequences() == [] and [g.abort_why for g in (stopped.gens[0], broken.gens[0])] == [None, None]


def test_discard_forgets_a_request_whose_submission_failed():
    table, request = LiveTable(), opened(n=2)
    table.add(request)
    table.discard(request)
    assert table.sequences() == [] and table.request("cmpl-a") is None
    assert table.unknown(DeltaBatch(1, [delta("cmpl-a.0", [5], 1)])) == ["cmpl-a.0"]


def test_an_adopted_request_replays_its_events_and_keeps_only_open_sequences():
    submit = SubmitRequest("cmpl-r", "api-1", [1, 2, 3], SamplingParams(max_tokens=8, n=2), arrival_time=0.0)
    meta = {"kind": "completion", "model": "smollm2", "stop": [], "created": 7}
    request = ApiRequest.adopted("cmpl-r", meta, submit).open("api-1", tokenizer(), ApiMetrics(), print, listen=False)
    events = [(1, {"index": 0, "token_ids": tokens()[:2]}), (2, {"index": 1, "token_ids": [], "finish_reason": "abort"}),
              (3, {"index": 0, "token_ids": tokens()[2:3]})]
    table = LiveTable()
    table.adopt(request, events)
    assert request.seq == 3 and request.gens[0].token_ids == tokens()[:3]
    assert request.gens[0].text == tokenizer().decode(tokens()[:3])
    assert [g.sequence_id for g in table.sequences()] == ["cmpl-r.0"] and table.knows("cmpl-r.1")
    assert table.request("cmpl-r") is request


def test_closing_a_request_ends_each_open_sequence_through_its_loop():
    request = opened(n=2)
    request.gens[1].finish("length", "length")
    request.close("client disconnected")
    assert ENDED == [("cmpl-a.0", "abort", "client disconnected")]


def test_the_table_remembers_a_bounded_number_of_ended_sequences():
    table = LiveTable(remember_ended=2)
    for s in ("a", "b", "c"):
        table.forget(s)
    assert [table.knows(s) for s in ("a", "b", "c")] == [False, True, True]


def test_outputs_a_reader_has_not_taken_come_merged():
    table, request = LiveTable(), opened()
    table.add(request)
    gen, ids = request.gens[0], tokens()[:5]
    for step, (new, total) in enumerate(((ids[:2], 2), (ids[2:3], 3), (ids[3:5], 5)), start=1):
        for g, out in table.apply(DeltaBatch(step, [delta("cmpl-a", new, total, "length" if total == 5 else None)]))[0]:
            out.seq = step
            g.outputs.put_nowait(out)
    run = asyncio.get_event_loop().run_until_complete
    out = run(gen.next())
    assert (out.token_ids, out.text, out.finish_reason, out.seq) == (ids, gen.text, "length", 3)
    assert run(gen.next()) is None
