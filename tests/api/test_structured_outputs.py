"""Structured outputs and tools at the edge (pure: real tokenizer, no server): every way of asking
-> the one GuidedDecoding the worker gets; every bad schema, regex, grammar or tool -> a 400 naming it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.api import tool_calls
from pagedserve.services.api.protocol import ApiError
from pagedserve.shared.messages import GuidedDecoding
from tests.api.test_inputs import CHAT, _error, _prepare

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SPEC = json.dumps(SCHEMA)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.mark.parametrize("extra, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     GuidedDecoding("json", SPEC)),
    ({"response_format": {"type": "json_object"}}, GuidedDecoding("json_object")),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, GuidedDecoding("json", SPEC)),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, GuidedDecoding("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no \"way\""]}},
     GuidedDecoding("grammar", 'root ::= "yes" | "no \\"way\\""')),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, GuidedDecoding("grammar", 'root ::= "a" | "b"')),
    ({"guided_json": json.dumps(SCHEMA)}, GuidedDecoding("json", SPEC)),
    ({"guided_regex": "a+"}, GuidedDecoding("regex", "a+")),
    ({"guided_choice": ["x"]}, GuidedDecoding("grammar", 'root ::= "x"')),
    ({"guided_grammar": 'root ::= "a"'}, GuidedDecoding("grammar", 'root ::= "a"')),
    ({}, None),
])
def test_each_way_of_asking_gives_one_guide(tokenizer, extra, expected):
    assert _prepare(tokenizer, {"messages": CHAT, **extra}).sampling.guided == expected


def test_completions_take_the_vllm_fields(tokenizer):
    assert _prepare(tokenizer, {"prompt": "hi", "guided_regex": "a+"}).sampling.guided == GuidedDecoding("regex", "a+")


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "'schema'"),
    ({"response_format": {"type": "xml"}}, "response_format", "'xml'"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems'"),
    ({"guided_json": {"type": "object", "properties": {"p": {"type": "array", "contains": {"type": "string"}}}}},
     "guided_json", "'properties.p.contains'"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regular expression"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "invalid regular expression"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "ask for one"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
])
def test_bad_requests_are_400_naming_the_problem(tokenizer, extra, param, words):
    error = _error(tokenizer, {"messages": CHAT, **extra})
    assert (error.status, error.param) == (400, param.split(".")[0].split("[")[0]) and words in error.message, error.message


def test_forced_tool_choice_constrains_to_the_call_schema(tokenizer):
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "tool_choice": named})
    assert request.tool_use.mode == "named" and request.sampling.guided.kind == "json"
    schema = json.loads(request.sampling.guided.spec)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    required = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"})
    assert json.loads(required.sampling.guided.spec)["type"] == "array"
    auto = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER]})
    assert auto.tool_use.mode == "auto" and auto.sampling.guided is None
    assert _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}).tool_use is None


def test_parallel_tool_calls_false_allows_one_call(tokenizer):
    """OpenAI's parallel_tool_calls: false bounds the required array to one call and keeps an auto
    answer's first call; the call schema keeps the order a tool call is written in (name first)."""
    required = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required",
                                    "parallel_tool_calls": False})
    schema = json.loads(required.sampling.guided.spec)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert list(schema["items"]["anyOf"][0]["properties"]) == ["name", "arguments"]
    parallel = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "tool_choice": "required"})
    assert "maxItems" not in json.loads(parallel.sampling.guided.spec)
    auto = _prepare(tokenizer, {"messages": CHAT, "tools": [WEATHER], "parallel_tool_calls": False})
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in tool_calls.parse(text, auto.tool_use)[1]] == ["f"]
    assert [c["function"]["name"] for c in tool_calls.parse(text, tool_calls.ToolUse("auto"))[1]] == ["f", "g"]


def test_tools_and_tool_results_reach_the_prompt(tokenizer):
    """SmolLM2's template takes no tools: a system message lists them; calls and results render as text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    request = _prepare(tokenizer, {"messages": messages, "tools": [WEATHER]})
    prompt = tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in prompt


def test_hermes_calls_are_parsed():
    use = tool_calls.ToolUse("auto")
    content, calls = tool_calls.parse('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "g", "arguments": {}}</tool_call>', use)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert tool_calls.parse("no call here", use) == ("no call here", [])
    assert tool_calls.parse("<tool_call>{broken", use) == ("<tool_call>{broken", [])
    _, required = tool_calls.parse('[{"name": "f", "arguments": {"a": 2}}]', tool_calls.ToolUse("required"))
    assert json.loads(required[0]["function"]["arguments"]) == {"a": 2}
    message, finish = tool_calls.assistant_message('{"name": "f", "arguments": {}}', "stop", tool_calls.ToolUse("named"))
    assert finish == "tool_calls" and message["content"] is None and message["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("text, limit", [("abc", 3), ("abc<tool", 3), ("abc<tool_call>{", 3), ("a<b", 3), ("<", 0)])
def test_streamed_content_stops_where_a_call_may_start(text, limit):
    assert tool_calls.held_back(text) == limit


def test_an_unparsable_assistant_call_is_400(tokenizer):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]
    error = _error(tokenizer, {"messages": messages})
    assert isinstance(error, ApiError) and error.param == "messages"


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["type", "function", "name", "schema", "json_schema", "json", "regex",
                                         "choice", "parameters", "properties", "items", "enum", "arguments"]),
                        inner, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(["response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                              "guided_grammar", "tools", "tool_choice"]), value=JSON)
def test_any_value_of_any_field_is_served_or_a_400(tokenizer, field, value):
    try:
        _prepare(tokenizer, {"messages": CHAT, field: value, "tools": [WEATHER]} if field == "tool_choice"
                 else {"messages": CHAT, field: value})
    except ApiError as e:
        assert e.status == 400


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(JSON, max_size=3))
def test_any_assistant_tool_calls_are_served_or_a_400(tokenizer, calls):
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": calls}]
    try:
        _prepare(tokenizer, {"messages": messages, "tools": [WEATHER]})
    except ApiError as e:
        assert e.status == 400


QWEN_LIKE = ("{%- if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
             "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
             "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
             "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_that_takes_tools_renders_them_itself(tokenizer):
    """Qwen2.5/Qwen3-style: tools and the assistant's calls (arguments as objects) go to the template."""
    import copy

    from pagedserve.shared.tokenizer import Tokenizer

    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = QWEN_LIKE
    native = Tokenizer(hf)
    assert native.renders_tools and not tokenizer.renders_tools
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "cold"}]
    request = _prepare(native, {"messages": messages, "tools": [WEATHER]})
    prompt = native.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert "<tools>get_weather;</tools>" in prompt and '<tool_call>get_weather {"city": "Oslo"}</tool_call>' in prompt
    assert "# Tools" not in prompt  # no system message of ours
