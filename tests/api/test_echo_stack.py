"""echo and prompt logprobs through the openai client on the real stack (float32 worker), equal to
HF transformers' float32 log_softmax over the same tokens; and the fast, pure parts of the worker's
prompt spans."""

from __future__ import annotations

import openai
import pytest
import torch

from pagedserve.services.gpu_worker.sampling.prompt_logprobs import PromptSpan, prompt_logprobs, prompt_span

TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the park, and"


def test_prompt_spans_cover_each_prompt_token_once_across_chunks():
    tokens, covered = list(range(100, 140)), []
    for start in range(0, 40, 16):  # chunks of 16 over a 40-token prompt, then one decode step
        span = prompt_span("r", 0, start, min(16, 40 - start), tokens, 40, 2)
        covered += span.targets if span else []
    assert covered == tokens[1:]
    assert prompt_span("r", 0, 40, 1, tokens + [7], 40, 2) is None  # a decode predicts no prompt token
    assert prompt_span("r", 0, 0, 16, tokens, 40, None) is None  # not asked


def test_each_prompt_token_gets_its_rank_as_vllm_counts_it():
    """Rank: how many tokens are at least as likely, itself included (1: the most likely)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    [out] = prompt_logprobs(lambda hidden: hidden, logits, [PromptSpan("r", 0, 1, 3, [2, 1, 3], 0)])
    assert out.ranks == [3, 2, 1] and out.first == 1 and [t.token_id for t in out.tokens] == [2, 1, 3]


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
        chosen, row = float(reference[i - 1, ids[i]]), reference[i - 1]  # its rank, up to float error
        rank_low, rank_high = int((row > chosen + 1e-3).sum()) + 1, int((row >= chosen - 1e-3).sum())
        assert rank_low <= entry[str(ids[i])]["rank"] <= rank_high
    chat = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
    plain = oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert plain.model_extra["prompt_logprobs"] is None  # vLLM's field is there, null, when not asked


@pytest.mark.slow
def test_a_streamed_echo_equals_the_whole_one(oai):
    """The prompt and its tokens' logprobs come first in each choice's stream, as vLLM streams them."""
    kw = dict(model="smollm2", prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    whole = oai.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(**kw, stream=True)]
    assert chunks[0].text.startswith(TEXT) and "".join(c.text for c in chunks) == whole.text
    streamed = {key: [v for c in chunks for v in getattr(c.logprobs, key)] for key in ("tokens", "text_offset")}
    assert streamed == {"tokens": whole.logprobs.tokens, "text_offset": whole.logprobs.text_offset}
    scores = [v for c in chunks for v in c.logprobs.token_logprobs]
    assert scores[0] is None and whole.logprobs.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(scores[1:], whole.logprobs.token_logprobs[1:], strict=True)) < 1e-4
    zero = [c.choices[0] for c in oai.completions.create(model="smollm2", prompt=TEXT, max_tokens=0, echo=True,
                                                          stream=True)]
    assert "".join(c.text for c in zero) == TEXT and zero[-1].finish_reason == "length"


@pytest.mark.slow
def test_echo_with_logprobs_and_n_scores_the_prompt_for_every_choice(oai, tokenizer):
    """n > 1 with prompt logprobs: n sequences of each prompt, choice i sampling as seed + i."""
    prompts = [TEXT, "Hello there"]
    kw = dict(model="smollm2", max_tokens=3, echo=True, logprobs=2, temperature=1.0)
    r = oai.completions.create(prompt=prompts, n=2, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    for choice, prompt in zip(r.choices, [TEXT, TEXT, prompts[1], prompts[1]], strict=True):
        assert choice.text.startswith(prompt) and choice.logprobs.token_logprobs[0] is None
    first, second = (c.logprobs.token_logprobs[:len(tokenizer.encode(TEXT))] for c in r.choices[:2])
    assert max(abs(a - b) for a, b in zip(first[1:], second[1:], strict=True)) < 1e-4
    for i in range(2):  # choice i is a lone request with seed + i
        alone = oai.completions.create(prompt=TEXT, n=1, seed=7 + i, **kw).choices[0]
        assert alone.text == r.choices[i].text


@pytest.mark.slow
def test_what_echo_cannot_serve_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="smollm2", prompt="hi", echo=True, max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):  # 0 only with echo
        oai.completions.create(model="smollm2", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError) as info:  # chat has no copies to make
        oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=1, n=2,
                                    extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "n"
