"""Structured outputs and tool calls through the real stack with the official openai client,
unchanged: response_format and vLLM's fields at temperature 1.0 validate, `parse` fills a pydantic
model, a streamed forced tool call is assembled by the client, tool results go back in, and a bad
schema is a 400 before anything runs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.structured.schemas import CHOICES, REGEX, SCHEMAS, check_json, check_regex

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.mark.parametrize("schema", [SCHEMAS[0], SCHEMAS[2], SCHEMAS[6], SCHEMAS[9]])
def test_chat_json_schema_validates_at_temperature_one(oai, schema):
    response = oai.chat.completions.create(
        model="smollm2", messages=ASK, temperature=1.0, max_tokens=160, n=2, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        check_json(choice.message.content, schema)


def test_completions_take_guided_fields(oai):
    out = oai.completions.create(model="smollm2", prompt="Answer yes or no:", max_tokens=20, temperature=1.0,
                                 n=2, extra_body={"guided_regex": REGEX})
    for choice in out.choices:
        check_regex(choice.text)
    out = oai.completions.create(model="smollm2", prompt="The review was", max_tokens=8, temperature=1.0,
                                 extra_body={"structured_outputs": {"choice": CHOICES}})
    assert out.choices[0].text in CHOICES
    out = oai.completions.create(model="smollm2", prompt="A person:", max_tokens=160, temperature=1.0,
                                 extra_body={"guided_json": SCHEMAS[3]})
    check_json(out.choices[0].text, SCHEMAS[3])


def test_streamed_json_object(oai):
    ask = [{"role": "user", "content": 'Reply with a JSON object like {"answer": "yes"}.'}]
    stream = oai.chat.completions.create(model="smollm2", messages=ask, temperature=0.0, max_tokens=200,
                                         response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


def test_parse_fills_a_pydantic_model(oai):
    completion = oai.beta.chat.completions.parse(model="smollm2", messages=ASK, temperature=1.0, max_tokens=120,
                                                 response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_streamed_forced_tool_call_is_assembled_by_the_client(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with oai.beta.chat.completions.stream(model="smollm2", messages=messages, tools=[WEATHER], temperature=1.0,
                                          max_tokens=120, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}}) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert arguments["unit"] in ("celsius", "fahrenheit")
    # the result goes back through the chat template and the model answers in text
    follow = oai.chat.completions.create(model="smollm2", temperature=0.0, max_tokens=12, tools=[WEATHER], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}])
    assert follow.choices[0].message.content


def test_required_and_auto_tool_choice(oai):
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    # sampled, one call at most: the grammar's array ends after it, well within max_tokens (parallel
    # calls at temperature 1.0 may go on past any max_tokens: the schema bounds no array)
    required = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, max_tokens=200)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city", "unit"}
    greedy = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required",
                                         temperature=0.0, max_tokens=200)  # parallel calls allowed
    choice = greedy.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert all(c.function.name == "get_weather" for c in choice.message.tool_calls)
    auto = oai.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], temperature=0.0,
                                       max_tokens=60)
    message = auto.choices[0].message
    assert message.tool_calls or message.content  # the model chose; either way a well-formed answer


def test_bad_schema_is_a_400_before_anything_runs(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="smollm2", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}})
    assert "uniqueItems" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="smollm2", prompt="x", extra_body={"guided_regex": "a(b"})
    assert "guided_regex" in str(info.value)


def test_tool_parameters_with_defs_and_refs_constrain_the_call(oai):
    """A parameters schema's "#/$defs/..." pointers (pydantic writes them) resolve within it, for a
    named call and for required ones, beside a tool without refs."""
    parameters = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}, "when": {"$ref": "#/$defs/Day"}},
                  "required": ["unit", "when"],
                  "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}, "Day": {"enum": ["today", "tomorrow"]}}}
    tools = [WEATHER, {"type": "function", "function": {"name": "get_forecast", "parameters": parameters}}]
    messages = [{"role": "user", "content": "What is the forecast for Rome?"}]
    named = {"type": "function", "function": {"name": "get_forecast"}}
    for choice, extra in ((named, {}), ("required", {"parallel_tool_calls": False})):
        r = oai.chat.completions.create(model="smollm2", messages=messages, tools=tools, tool_choice=choice,
                                        temperature=1.0, max_tokens=120, **extra)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason in ("stop", "tool_calls") and len(calls) == 1
        arguments = json.loads(calls[0].function.arguments)
        if calls[0].function.name == "get_forecast":
            jsonschema.validate(arguments, parameters)
        else:
            assert set(arguments) == {"city", "unit"} and choice == "required"
