"""A record event reads back as it was written, whichever JSON encoder wrote it."""

from __future__ import annotations

import json

from pagedserve.services.api.records import _event_json


def test_an_event_reads_back_equal_non_ascii_and_control_characters_included():
    event = {"index": 1, "text": "é \u2028\x00\n\"", "token_ids": [5, 7], "text_offset": 3, "token_offset": 2,
             "finish_reason": "stop", "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    assert isinstance(_event_json(event), bytes)
    assert json.loads(_event_json(event)) == event


def test_a_minus_infinite_logprob_reads_back():
    event = {"index": 0, "text": "a", "token_ids": [9], "text_offset": 0, "token_offset": 0,
             "logprobs": [{"token_id": 9, "logprob": float("-inf"), "top_logprobs": [[9, float("-inf")]]}]}
    assert json.loads(_event_json(event))["logprobs"][0]["logprob"] == float("-inf")
