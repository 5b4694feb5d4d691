"""Constrained decoding in the in-process engine on the real model, at temperature 1.0: every
output of every schema, regex and choice validates; a preempted sequence (its matcher rebuilt by
replaying its tokens) and n > 1 (a matcher per choice) give exactly what an undisturbed run gives;
strict tools in tool_choice "auto" write calls that validate."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from pagedserve.services.api import tool_calls
from pagedserve.services.engine import Engine
from pagedserve.shared.messages import GuidedDecoding, SamplingParams
from tests.api.test_inputs import _prepare
from tests.structured.schemas import CHOICES, REGEX, SCHEMAS, check_json, check_regex

pytestmark = pytest.mark.slow
SAMPLES = 5


@pytest.fixture(scope="module")
def engine():
    return Engine(num_blocks=512)


def _prompt(engine, what: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Answer with {what}."}])


def _params(guided: GuidedDecoding, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=160, temperature=1.0, seed=seed, guided=guided, **kw)


def test_every_sample_of_every_schema_validates(engine):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        for k in range(SAMPLES):
            prompts.append(_prompt(engine, f"JSON matching {json.dumps(schema)}"))
            params.append(_params(GuidedDecoding("json", json.dumps(schema)), seed=100 * i + k))
    outputs = engine.generate(prompts, params, decode=True)
    for i, out in enumerate(outputs):
        assert out.finish_reason == "stop", out.text
        check_json(out.text, SCHEMAS[i // SAMPLES])
    assert len({o.text for o in outputs[:SAMPLES]}) > 1  # temperature 1.0 really samples


def test_regex_choice_and_json_object_validate(engine):
    choice = "root ::= " + " | ".join(json.dumps(c) for c in CHOICES)
    guides = [GuidedDecoding("regex", REGEX)] * SAMPLES + [GuidedDecoding("grammar", choice)] * SAMPLES + \
        [GuidedDecoding("json_object")] * SAMPLES
    outputs = engine.generate([_prompt(engine, "a word")] * len(guides),
                              [_params(g, seed=i) for i, g in enumerate(guides)], decode=True)
    for out in outputs[:SAMPLES]:
        check_regex(out.text)
    assert {o.text for o in outputs[SAMPLES:2 * SAMPLES]} <= set(CHOICES)
    ended = [out for out in outputs[2 * SAMPLES:] if out.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(out.text), dict) for out in ended)
    for out in outputs[2 * SAMPLES:]:  # one that ran out of tokens holds an object's start, token for token
        matcher = engine.worker.grammars.sequence(GuidedDecoding("json_object"), []).matcher()
        assert all(matcher.accept_token(t) for t in out.token_ids), out.text


def test_preempted_sequences_replay_their_matcher(engine):
    """A pool too small for all eight: sequences are preempted and resumed (recomputed from prompt
    plus output, matcher replayed), and each gives the tokens it gives alone (seeded)."""
    schema = SCHEMAS[7]
    prompts = [_prompt(engine, f"points as JSON {i}") for i in range(8)]
    params = [_params(GuidedDecoding("json", json.dumps(schema)), seed=7 + i) for i in range(8)]
    alone = engine.generate(prompts, params, decode=True)
    small = Engine(num_blocks=3 * 8 + 1)  # the 8 prompts' blocks and one: the second to grow preempts
    small.worker.grammars = engine.worker.grammars  # the compiled grammar cache, as a long-lived worker has
    crowded = small.generate(prompts, params, decode=True)
    assert small.scheduler.stats().num_preemptions_total > 0
    assert [o.token_ids for o in crowded] == [o.token_ids for o in alone]
    for out in crowded:
        check_json(out.text, schema)


def test_each_of_n_choices_has_its_own_matcher(engine):
    schema = SCHEMAS[0]
    out = engine.generate([_prompt(engine, "a person")], _params(GuidedDecoding("json", json.dumps(schema)), seed=3,
                                                                   n=4), decode=True)[0]
    texts = [c.text for c in out.choices]
    for text in texts:
        check_json(text, schema)
    assert len(set(texts)) > 1




def test_strict_tools_in_auto_write_calls_that_validate(engine, tokenizer):
    """tool_choice "auto" with a strict function (xgrammar's triggered tags), the model pushed to open
    a call by a logit_bias on "<tool_call>"'s tokens: each call's arguments follow the strict schema
    (the bias stays on inside them), and parallel_tool_calls false ends the output after the call."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema, "strict": True}}
    bias = {str(t): 100 for t in tokenizer.encode("<tool_call>", add_special_tokens=False)}
    request = _prepare(tokenizer, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
                                   "logit_bias": bias, "temperature": 1.0, "max_tokens": 100,
                                   "parallel_tool_calls": False})
    params = [dataclasses.replace(request.sampling, seed=s) for s in range(SAMPLES)]
    outputs = engine.generate([request.prompt_token_ids] * SAMPLES, params, decode=True)
    for out in outputs:
        message, finish = tool_calls.assistant_message(out.text, out.finish_reason, request.tool_use)
        assert out.finish_reason == "stop" and finish == "tool_calls", out.text
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
