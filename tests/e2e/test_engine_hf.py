"""The in-process engine against HF transformers: greedy, float32, same weights.

Token-for-token equality for six chat prompts run alone, run together with staggered
arrivals under a token budget that forces chunked prefill, and run through a pool too
small to hold them all (preemption and recompute).
"""

from __future__ import annotations

import pytest

from pagedserve.services.engine import Engine, GenerationOutput
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "What is 12 times 7?",
    "Give me one tip for learning to program.",
]
MAX_NEW_TOKENS = 40


def _strip_eos(tokens: list[int], eos: list[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else list(tokens)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompt_ids, tokenizer) -> list[list[int]]:
    import torch

    out = []
    for ids in prompt_ids:
        with torch.inference_mode():
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_ids, pad_token_id=tokenizer.eos_token_ids[0])
        out.append(_strip_eos(gen[0, len(ids):].tolist(), tokenizer.eos_token_ids))
    return out


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)


def _tokens(outputs: list[GenerationOutput], eos: list[int]) -> list[list[int]]:
    return [_strip_eos(o.token_ids, eos) for o in outputs]


def test_each_prompt_alone_matches_hf(prompt_ids, hf_tokens, tokenizer):
    engine = Engine(EngineConfig(dtype="float32", num_blocks=64))
    for ids, expected in zip(prompt_ids, hf_tokens, strict=False):
        (out,) = engine.generate([ids], _params())
        assert _strip_eos(out.token_ids, tokenizer.eos_token_ids) == expected
        assert out.finish_reason in ("stop", "length")
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_held_blocks == 0
    paris = tokenizer.decode(hf_tokens[0])
    assert "Paris" in paris


def test_staggered_arrivals_with_chunked_prefill_match_hf(prompt_ids, hf_tokens, tokenizer):
    # budget 24 < every prompt's length (~35 tokens): every prefill is chunked, and decodes
    # of earlier requests share steps with later prefills
    engine = Engine(EngineConfig(dtype="float32", num_blocks=128, max_num_batched_tokens=24, max_num_seqs=4))
    assert min(len(ids) for ids in prompt_ids) > 24
    outputs: dict[str, GenerationOutput] = {}
    order: list[str] = []
    pending = list(prompt_ids)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new arrival every third step
            ids = pending.pop(0)
            request_id = engine.add_request(ids, _params())
            order.append(request_id)
            outputs[request_id] = GenerationOutput(request_id, ids)
        Engine.collect(engine.step(), outputs)
        engine.block_manager.check_integrity()
        step += 1
    assert _tokens([outputs[r] for r in order], tokenizer.eos_token_ids) == hf_tokens
    assert engine.block_manager.num_held_blocks == 0


def test_pool_too_small_preempts_and_still_matches_hf(prompt_ids, hf_tokens, tokenizer):
    # each request needs ~5 blocks of 16 at its end; 12 blocks hold two at a time
    engine = Engine(EngineConfig(dtype="float32", num_blocks=12, max_num_batched_tokens=64))
    outputs = engine.generate(prompt_ids, [_params() for _ in prompt_ids])
    assert _tokens(outputs, tokenizer.eos_token_ids) == hf_tokens
    assert engine.block_manager.stats()["num_preemptions"] > 0
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_held_blocks == 0


def test_all_together_text_reads_as_english(prompt_ids, tokenizer):
    engine = Engine(EngineConfig(dtype="float32", num_blocks=128))
    outputs = engine.generate(prompt_ids, _params(), decode=True)
    for out in outputs:
        words = out.text.split()
        assert len(words) >= 3, out.text
        letters = sum(c.isalpha() or c.isspace() for c in out.text)
        assert letters / max(1, len(out.text)) > 0.7, out.text
