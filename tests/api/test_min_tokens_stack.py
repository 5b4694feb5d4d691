"""vLLM's min_tokens through the openai client (extra_body) on the real stack: a stop token, EOS or
a stop string that would end the output early waits until min_tokens tokens were generated."""

from __future__ import annotations

import pytest

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.mark.slow
def test_a_stop_token_id_and_a_stop_string_wait_for_min_tokens_on_completions(oai, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    text = oai.completions.create(model="smollm2", prompt=prompt_ids, max_tokens=6, temperature=0).choices[0].text
    ids = tokenizer.encode(PROMPT + text)
    assert ids[:len(prompt_ids)] == prompt_ids
    kw = dict(model="smollm2", prompt=prompt_ids, max_tokens=6, temperature=0)
    stopped = oai.completions.create(**kw, extra_body={"stop_token_ids": [ids[len(prompt_ids)]]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = oai.completions.create(**kw, extra_body={"stop_token_ids": [ids[len(prompt_ids)]], "min_tokens": 6})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "length"
    assert held.choices[0].text != text  # its first token was masked: a different continuation
    first_word = text.split()[0]
    cut = oai.completions.create(**kw, stop=[first_word])
    assert cut.choices[0].finish_reason == "stop" and first_word not in cut.choices[0].text
    late = oai.completions.create(**kw, stop=[first_word], extra_body={"min_tokens": 6})
    assert late.choices[0].text == text and late.usage.completion_tokens == 6


@pytest.mark.slow
def test_eos_waits_for_min_tokens_on_chat_streamed_or_not(oai):
    free = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=200, temperature=0)
    assert free.choices[0].finish_reason == "stop"
    wanted = free.usage.completion_tokens + 5
    kw = dict(model="smollm2", messages=CHAT, max_tokens=wanted, temperature=0, extra_body={"min_tokens": wanted})
    held = oai.chat.completions.create(**kw)
    assert held.usage.completion_tokens == wanted and held.choices[0].finish_reason == "length"
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == wanted
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == held.choices[0].message.content


@pytest.mark.slow
def test_min_tokens_above_max_tokens_is_a_400_naming_it(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, extra_body={"min_tokens": 4})
    assert info.value.body["param"] == "min_tokens"
