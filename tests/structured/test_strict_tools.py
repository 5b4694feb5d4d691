"""`strict` at the edge and in the grammar: in tool_choice "auto", strict functions make every
<tool_call> the model opens a constrained one (xgrammar's triggered tags) while text stays free;
xgrammar's structural tags are also taken as a response_format; a `strict` that is not a boolean is
a 400. The compiled grammar is the worker's (sampling/grammar.py), fed the tokens of real text."""

from __future__ import annotations

import json

import pytest

from pagedserve.services.gpu_worker.sampling.grammar import Grammars
from pagedserve.shared.messages import GuidedDecoding
from tests.api.test_inputs import CHAT, _error, _prepare

EOS, VOCAB = 2, 49152
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}  # not strict
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def grammars():
    return Grammars("smollm2", VOCAB, [EOS], overlap=False)


def _takes(grammars, tokenizer, guide: GuidedDecoding, text: str) -> bool:
    """Whether the grammar takes every token of text and then the end."""
    matcher = grammars.sequence(guide, []).matcher()
    tokens = tokenizer.encode(text, add_special_tokens=False) + [EOS]
    return all(matcher.accept_token(t) for t in tokens)


def test_strict_tools_in_auto_constrain_each_call_and_leave_text_free(grammars, tokenizer):
    request = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER, NOTE]})
    guide = request.sampling.guided
    assert request.tool_use.mode == "auto" and guide.kind == "structural_tag"
    good = CALL.format(name="get_weather", arguments='{"city": "Paris", "unit": "c"}')
    assert _takes(grammars, tokenizer, guide, "Sure, let me check.\n" + good + "\nDone.")
    assert _takes(grammars, tokenizer, guide, "No call needed: it is sunny.")
    assert _takes(grammars, tokenizer, guide, CALL.format(name="note", arguments='{"anything": [1, 2]}'))
    assert _takes(grammars, tokenizer, guide, good + good)  # parallel calls by default
    for bad in (CALL.format(name="get_weather", arguments='{"city": "Paris"}'),  # a required argument missing
                CALL.format(name="get_weather", arguments='{"city": "Paris", "unit": "k"}'),
                CALL.format(name="get_time", arguments="{}"),  # no such function
                CALL.format(name="note", arguments="[1]")):  # not an object
        assert not _takes(grammars, tokenizer, guide, bad), bad
    one = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "parallel_tool_calls": False}).sampling.guided
    assert _takes(grammars, tokenizer, one, good) and not _takes(grammars, tokenizer, one, good + good)


def test_tools_without_strict_leave_auto_unconstrained(tokenizer):
    for tools in ([NOTE], [{"type": "function", "function": {**WEATHER["function"], "strict": False}}]):
        assert _prepare(tokenizer, {"messages": CHAT, "tools": tools}).sampling.guided is None


def test_a_structural_tag_response_format_is_served(grammars, tokenizer):
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<answer>"], "tags": [
        {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": CITY}, "end": "</answer>"}]}}
    guide = _prepare(tokenizer, {"messages": CHAT, "response_format": tag}).sampling.guided
    assert guide == GuidedDecoding("structural_tag", json.dumps(tag))
    assert _takes(grammars, tokenizer, guide, 'It is <answer>{"city": "Oslo", "unit": "f"}</answer>')
    assert not _takes(grammars, tokenizer, guide, '<answer>{"city": 3}</answer>')


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY, "strict": 1}}},
     "response_format", "strict must be a boolean"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>"}}}, "response_format",
     "invalid structural tag"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "format must be"),
    ({"tools": [WEATHER], "guided_regex": "a"}, "tool_choice", "strict tools cannot be combined"),
])
def test_bad_strict_and_structural_tags_are_400(tokenizer, extra, param, words):
    error = _error(tokenizer, {"messages": CHAT, **extra})
    assert (error.status, error.param) == (400, param) and words in error.message, error.message
