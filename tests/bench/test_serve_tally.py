"""The load generator's chunk reader: which SSE chunks carry text, and the token count,
without parsing the JSON of every chunk, and the same answer as parsing it."""

from __future__ import annotations

import json

import pytest

from pagedserve.services.bench.serve_client import RequestRecord, _has_text, _Tally


def _chunk(text: str | None, usage: dict | None = None, spaced: bool = False) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]
    body = {"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": usage}
    return json.dumps(body, separators=(", ", ": ") if spaced else (",", ":")).encode()


@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize(("text", "expected"), [
    ("hello", True), ("", False), ('"text":""', True), ("\\", True), ('say "hi"', True),
])
def test_text_found_without_parsing(text, expected, spaced):
    assert _has_text(_chunk(text, spaced=spaced)) is expected


@pytest.mark.parametrize("data", [
    _chunk(None, usage={"completion_tokens": 3}),  # the usage chunk: its count is needed
    _chunk("a", usage={"completion_tokens": 3}),
    b'{"choices":[{"index":0,"text":"a"},{"index":1,"text":"b"}]}',  # n > 1
    b'{"choices":[{"index":0,"delta":{"content":"a"}}]}',  # chat: not a completion chunk
    '{"choices":[{"index":0,"text":"a"}]}',  # str from httpx's line reader
])
def test_anything_else_is_parsed(data):
    assert _has_text(data) is None


def test_tally_counts_text_chunks_and_takes_the_server_usage():
    record = RequestRecord()
    tally = _Tally(record, started=0.0)
    for i, data in enumerate([_chunk(""), _chunk("a"), _chunk(" b", spaced=True), _chunk(""),
                              _chunk(None, usage={"completion_tokens": 4}), b"[DONE]", _chunk("late")]):
        tally.on_data(data, now=1.0 + i)
    tally.finish()
    assert (record.ttft_s, record.itl_s, record.num_output_tokens, tally.num_chunks) == (2.0, [1.0], 4, 2)
