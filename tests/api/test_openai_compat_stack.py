"""OpenAI compatibility as other servers' tests see it, through the official openai client on
the real stack (api -> scheduler -> kvstore/worker processes, float32): strict fields, JSON
bodies only, models.retrieve, logprobs 0, prompt_tokens_details, lists of prompts with `n`
(streamed or not), logit_bias.
"""

from __future__ import annotations

import openai
import pytest

from tests.services.conftest import wait_for

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
CHAT = [{"role": "user", "content": "Say hi"}]


def _greedy(oai, prompt, max_tokens=6, **kw):
    return oai.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("route,extra,param", [
    ("chat", {"response_format": {"type": "bogus"}}, "response_format"),
    ("chat", {"store": True}, "store"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("completion", {"logit_bias": {"5": -101}}, "logit_bias"),
])
def test_a_field_we_cannot_honour_is_a_400_naming_it(oai, route, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, extra_body=extra)
        else:
            oai.completions.create(model="smollm2", prompt="hi", max_tokens=2, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and param in error["message"], error


def test_neutral_values_of_unimplemented_fields_are_served(oai):
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0, store=False,
                                    modalities=["text"], response_format={"type": "text"}, service_tier="auto")
    assert r.choices[0].finish_reason == "length"


def test_only_json_bodies(stack_api):
    with stack_api.client() as c:
        r = c.post("/v1/completions", data={"prompt": "hi", "max_tokens": "2"})  # form-urlencoded
        assert r.status_code == 415 and r.json()["error"]["param"] == "content-type", r.text
        r = c.post("/v1/chat/completions", content=b'{"messages": []}', headers={"Content-Type": "text/plain"})
        assert r.status_code == 415


def test_models_retrieve(oai):
    model = oai.models.retrieve("smollm2")
    assert model.id == "smollm2" and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")


def test_logprobs_zero_gives_the_chosen_token_alone_and_usage_has_details(oai):
    r = _greedy(oai, "Hello", logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]
    assert r.choices[0].prompt_logprobs is None  # vLLM's field, null unless asked
    five = _greedy(oai, "Hello", logprobs=5).choices[0].logprobs.top_logprobs
    assert all(5 <= len(top) <= 6 for top in five)
    assert all(isinstance(v, float) for v in lp.token_logprobs)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    chat = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens_details is not None


def test_a_list_of_prompts_with_n_answers_each_choice_at_its_openai_index(oai):
    alone = [_greedy(oai, p).choices[0].text for p in PROMPTS]
    r = _greedy(oai, PROMPTS, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    assert r.usage.completion_tokens == 6 * 6
    assert r.usage.prompt_tokens == sum(_greedy(oai, p).usage.prompt_tokens for p in PROMPTS)
    tokens = [[1, 2, 3, 4], [5, 6, 7]]
    as_ids = _greedy(oai, tokens)
    assert [c.text for c in as_ids.choices] == [_greedy(oai, t).choices[0].text for t in tokens]


def test_a_list_of_prompts_streams_every_choice(oai):
    alone = [_greedy(oai, p).choices[0].text for p in PROMPTS]
    texts, finishes = [""] * 6, [None] * 6
    for chunk in _greedy(oai, PROMPTS, n=2, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        usage = chunk.usage
    assert texts == [t for t in alone for _ in range(2)] and all(finishes)
    assert usage.completion_tokens == 36


def test_prompts_of_a_list_run_together_and_a_hang_up_aborts_them_all(oai, backend):
    """Six prompts that run until stopped: all six run at once (the same steps), and closing the
    stream frees every one's blocks."""
    kv_before = backend.wait_kvstore_clean(timeout=120)  # nothing of an earlier test still runs
    stream = _greedy(oai, PROMPTS * 2, stream=True, extra_body={"max_tokens": 3000, "ignore_eos": True})
    next(iter(stream))
    wait_for(lambda: backend.stats("scheduler")["num_requests_running"] >= 6, 120, "six prompts running at once")
    stream.close()
    backend.wait_kvstore_clean(timeout=120, since=kv_before)


def test_logit_bias_steers_greedy_output(oai, tokenizer):
    plain = _greedy(oai, "The capital of France is", max_tokens=3)
    first = tokenizer.encode(plain.choices[0].text)[0]
    banned = _greedy(oai, "The capital of France is", max_tokens=3, logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text)[0] != first
    forced_id = tokenizer.encode(" banana")[0]
    forced = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, temperature=0.8, seed=1,
                                         logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == tokenizer.decode([forced_id] * 3)
