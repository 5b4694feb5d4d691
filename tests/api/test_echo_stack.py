"""echo and prompt logprobs through the openai client on the real stack (float32 worker), equal to
HF transformers' float32 log_softmax over the same tokens; and the fast, pure parts of the worker's
prompt spans."""

from __future__ import annotations

import openai
import pytest
import torch

from pagedserve.services.gpu_worker.sampling.prompt_logprobs import prompt_span

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and"


def test_prompt_spans_cover_each_prompt_token_once_across_chunks():
    tokens, covered = list(range(100, 140)), []
    for start in range(0, 40, 16):  # chunks of 16 over a 40-token prompt, then one decode step
        span = prompt_span("r", 0, start, min(16, 40 - start), tokens, 40, 2)
        covered += span.targets if span else []
    assert covered == tokens[1:]
    assert prompt_span("r", 0, 40, 1, tokens + [7], 40, 2) is None  # a decode predicts no prompt token
    assert prompt_span("r", 0, 0, 16, tokens, 40, None) is None  # not asked


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, tokenizer):
    ids = tokenizer.encode(TEXT)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return ids, logits.log_softmax(-1)


@pytest.mark.slow
def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_hf_does(oai, hf_logprobs):
    ids, reference = hf_logprobs
    r = oai.completions.create(model="smollm2", prompt=TEXT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == TEXT and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected, strict=True)) < 1e-3
    for i in range(1, len(ids)):  # the most likely token and the prompt's own, as OpenAI gives them
        top = lp.top_logprobs[i]
        assert abs(max(top.values()) - float(reference[i - 1].max())) < 1e-3
        assert top[lp.tokens[i]] == lp.token_logprobs[i] and len(top) in (1, 2)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.slow
def test_echo_then_generate_and_vllm_prompt_logprobs(oai, hf_logprobs, tokenizer):
    ids, reference = hf_logprobs
    plain = oai.completions.create(model="smollm2", prompt=TEXT, max_tokens=4, temperature=0)
    echoed = oai.completions.create(model="smollm2", prompt=TEXT, max_tokens=4, echo=True, temperature=0)
    assert echoed.choices[0].text == TEXT + plain.choices[0].text and echoed.choices[0].logprobs is None
    r = oai.completions.create(model="smollm2", prompt=ids, max_tokens=1, temperature=0,
                               extra_body={"prompt_logprobs": 2})
    prompt_logprobs = r.choices[0].model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        assert abs(entry[str(ids[i])]["logprob"] - float(reference[i - 1, ids[i]])) < 1e-3
        top2 = reference[i - 1].topk(2).indices.tolist()
        assert all(str(t) in entry for t in top2) and len(entry) in (2, 3)
    chat = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


@pytest.mark.slow
def test_what_echo_cannot_serve_is_a_400(oai):
    for extra, param in (({"n": 2, "logprobs": 1}, "n"), ({"stream": True}, "echo"), ({"max_tokens": -1}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="smollm2", prompt="hi", echo=True, extra_body={"max_tokens": 0, **extra})
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError):  # 0 only with echo
        oai.completions.create(model="smollm2", prompt="hi", max_tokens=0)
