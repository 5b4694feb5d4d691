"""Sampling through the in-process engine with the real model (float32): a seeded request
gives the same tokens alone, batched with others, and through preemption; penalties and
stop token ids act on the real output."""

from __future__ import annotations

import pytest

from pagedserve.services.engine import Engine
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["Tell me a story about a dragon.", "Name some colours.", "Why do cats purr?", "Count to ten."]
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine(engine_f32):
    return engine_f32


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(engine, prompt_ids):
    (alone,) = engine.generate([prompt_ids[0]], SEEDED)
    (again,) = engine.generate([prompt_ids[0]], SEEDED)
    assert again.token_ids == alone.token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0), SamplingParams(max_tokens=20, temperature=0.0),
              SamplingParams(max_tokens=12, temperature=0.7, seed=7)]
    batched = engine.generate([prompt_ids[1], prompt_ids[0], prompt_ids[2], prompt_ids[3]],
                              [others[0], SEEDED, others[1], others[2]])
    assert batched[1].token_ids == alone.token_ids
    other_seed = engine.generate([prompt_ids[0]], SamplingParams(**{**SEEDED.__dict__, "seed": 43}))[0]
    assert other_seed.token_ids != alone.token_ids


def test_seeded_sampling_survives_preemption(engine, prompt_ids):
    (alone,) = engine.generate([prompt_ids[0]], SEEDED)
    # four copies need ~4 x 7 blocks of 8 at the end; the pool has 14: some are preempted
    small = Engine(EngineConfig(dtype="float32", num_blocks=14, block_size=8))
    outs = small.generate([prompt_ids[0]] * 4, [SEEDED] * 4)
    assert small.scheduler.stats().num_preemptions_total > 0
    assert [out.token_ids for out in outs] == [alone.token_ids] * 4
    assert small.block_manager.num_free_blocks == 14


def test_penalties_and_stop_token_ids_shape_the_real_output(engine, prompt_ids):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (plain,) = engine.generate([prompt_ids[3]], greedy)
    (penalised,) = engine.generate([prompt_ids[3]], SamplingParams(**{**greedy.__dict__, "frequency_penalty": 2.0,
                                                                     "presence_penalty": 2.0}))
    assert penalised.token_ids != plain.token_ids
    repeats = lambda ids: len(ids) - len(set(ids))
    assert repeats(penalised.token_ids) < repeats(plain.token_ids)
    stop_id = plain.token_ids[5]
    (stopped,) = engine.generate([prompt_ids[3]], SamplingParams(**{**greedy.__dict__, "stop_token_ids": [stop_id]}))
    first = plain.token_ids.index(stop_id)
    assert stopped.token_ids == plain.token_ids[:first + 1] and stopped.finish_reason == "stop"


def test_the_engine_refuses_what_the_api_refuses(engine):
    from pagedserve.shared.prompt_check import PromptRejected

    vocab, context = engine.worker.model_config.vocab_size, engine.max_model_len
    refusals = {(): "the prompt is empty", (1, vocab): f"prompt token id {vocab} is out of vocabulary",
                (1,) * context: "the prompt alone has", (1,): "max_tokens must be at least 1, got 0"}
    for prompt, message in refusals.items():
        with pytest.raises(PromptRejected, match=message.replace("(", r"\(")):
            engine.add_request(list(prompt), SamplingParams(max_tokens=0 if prompt == (1,) else 4))
    with pytest.raises(PromptRejected, match="max_tokens asks for 8 more"):
        engine.add_request([1] * (context - 4), SamplingParams(max_tokens=8))
    assert not engine.has_unfinished_requests()
