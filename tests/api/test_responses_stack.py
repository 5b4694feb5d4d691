"""The Responses API (POST /v1/responses) through the openai client's responses.create on the
real stack: the same engine path as chat (greedy text equal to chat's), streamed with its
event types in order, and a 400 naming what it does not serve."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

INSTRUCTIONS = "You are terse."
QUESTION = "What is the capital of France?"


def _chat_text(oai, max_tokens: int) -> str:
    r = oai.chat.completions.create(model="smollm2", temperature=0, max_tokens=max_tokens,
                                    messages=[{"role": "system", "content": INSTRUCTIONS},
                                              {"role": "user", "content": QUESTION}])
    return r.choices[0].message.content


def test_a_response_equals_the_chat_answer(oai):
    expected = _chat_text(oai, 12)
    r = oai.responses.create(model="smollm2", instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                             max_output_tokens=12)
    assert r.object == "response" and r.output_text == expected
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 12
    assert r.usage.input_tokens > 0 and r.usage.input_tokens_details.cached_tokens >= 0
    as_items = oai.responses.create(model="smollm2", temperature=0, max_output_tokens=12, input=[
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert as_items.output_text == expected


def test_a_streamed_response_sends_its_events_in_order(oai):
    expected = _chat_text(oai, 5)
    events = list(oai.responses.create(model="smollm2", instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
                                       max_output_tokens=5, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 5


@pytest.mark.parametrize("extra,param", [({"previous_response_id": "resp_1"}, "previous_response_id"),
                                         ({"tools": [{"type": "web_search"}]}, "tools"),
                                         ({"text": {"format": {"type": "json_object"}}}, "text"),
                                         ({"input": [{"type": "function_call_output"}]}, "input")])
def test_what_it_does_not_serve_is_a_400(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="smollm2", input="hi", max_output_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param


def test_store_true_is_served_and_nothing_is_stored(oai):
    """store defaults to true in OpenAI's API; as vLLM without --enable-store, the answer comes and
    says store: false."""
    r = oai.responses.create(model="smollm2", input="hi", max_output_tokens=2, store=True, truncation="disabled")
    assert r.status in ("completed", "incomplete") and r.store is False


def test_logprobs_when_included_equal_chats_whole_and_streamed(oai):
    ask = dict(model="smollm2", instructions=INSTRUCTIONS, input=QUESTION, temperature=0, max_output_tokens=6)
    chat = oai.chat.completions.create(messages=[{"role": "system", "content": INSTRUCTIONS},
                                                 {"role": "user", "content": QUESTION}], model="smollm2",
                                       temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    expected = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]
    r = oai.responses.create(**ask, top_logprobs=3, include=["message.output_text.logprobs"])
    got = r.output[0].content[0].logprobs
    assert [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in got] == expected
    events = list(oai.responses.create(**ask, top_logprobs=3, include=["message.output_text.logprobs"], stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert [(t.token, t.logprob) for t in streamed] == [(t, lp) for t, lp, _ in expected]
    assert oai.responses.create(**ask).output[0].content[0].logprobs == []


def test_replayed_reasoning_items_and_effort_none_are_served(oai):
    turn = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Paris."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And of Spain?"}]}]
    ask = dict(model="smollm2", temperature=0, max_output_tokens=8)
    plain = oai.responses.create(input=turn, **ask).output_text
    reasoning = {"type": "reasoning", "id": "rs_1", "status": "completed", "summary": [], "encrypted_content": None}
    assert oai.responses.create(input=turn[:2] + [reasoning] + turn[2:], **ask).output_text == plain
    assert oai.responses.create(input=turn, reasoning={"effort": "none"}, **ask).output_text == plain
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(input=turn, reasoning={"effort": "low"}, **ask)
    assert info.value.body["param"] == "reasoning"


def test_sampling_fields_beyond_openais_reach_the_sampler(oai):
    ask = dict(model="smollm2", input=QUESTION, temperature=1.0, max_output_tokens=8)
    chat = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                       temperature=1.0, max_tokens=8, seed=7, extra_body={"top_k": 5})
    seeded = [oai.responses.create(**ask, extra_body={"seed": 7, "top_k": 5}).output_text for _ in range(2)]
    assert seeded == [chat.choices[0].message.content] * 2
