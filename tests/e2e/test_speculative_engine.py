"""Speculative decoding (ngram, suffix) on the real model (SmolLM2, float32; bf16 alone too) in the in-process engine: greedy
tokens equal those without speculation alone, batched, with prefix caching and after preemption; a
seeded sampled request gives the same tokens with or without; drafts are verified and accepted."""

from __future__ import annotations

import pytest

from pagedserve.services.engine import Engine
from pagedserve.services.gpu_worker.device import cpu_has_bf16
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "learn_step_costs": False}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [f"Rewrite this code with type hints:\n{CODE}\nAnswer:\n",
           "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "What is the capital of France?"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _engine(speculative: dict | None, **overrides) -> Engine:
    return Engine(EngineConfig(**{"dtype": "float32", "num_blocks": 96, "speculative_config": speculative,
                                  **overrides}))


@pytest.fixture(scope="module")
def engines() -> dict[bool, Engine]:
    return {False: _engine(None), True: _engine(NGRAM)}


def _tokens(engine: Engine, prompts, params) -> list[list[int]]:
    outs = [o.token_ids for o in engine.generate(prompts, params)]
    assert not engine.scheduler.has_requests()
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_held_blocks == 0
    return outs


def test_alone_and_batched_greedy_tokens_are_the_same_and_drafts_are_accepted(engines):
    counters = engines[True].scheduler._speculator.counters
    before = counters.num_accepted_tokens
    for prompts in ([PROMPTS[0]], PROMPTS):
        assert _tokens(engines[True], prompts, GREEDY) == _tokens(engines[False], prompts, GREEDY)
    assert counters.num_accepted_tokens - before > 20  # the rewrite quotes its input
    assert engines[False].scheduler._speculator.counters.num_drafts == 0


@pytest.mark.skipif(not cpu_has_bf16(), reason="bf16 products need AVX-512 BF16 or AMX")
def test_bf16_greedy_tokens_are_the_same_alone():
    # with AMX, verification rows taking tiles changed these two grounded edits by token 52
    from pagedserve.services.bench.grounded_workload import grounded_edits

    spec = {**NGRAM, "num_speculative_tokens": 6, "prompt_lookup_max": 5}
    on, off = _engine(spec, dtype="bfloat16"), _engine(None, dtype="bfloat16")
    for request in [grounded_edits()[i] for i in (7, 14)]:
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        assert _tokens(on, [request["prompt_token_ids"]], params) == _tokens(off, [request["prompt_token_ids"]], params)


def test_the_worker_times_each_step_for_the_draft_cost_table():
    engine = _engine({"method": "ngram", "num_speculative_tokens": 4})
    times = engine.scheduler._speculator.step_times
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    counts = {key: b.count for key, b in times._buckets.items()}
    assert times.learns and sum(counts.values()) >= 6 and all(b.point()[1] > 0 for b in times._buckets.values())


def test_suffix_drafts_keep_the_greedy_tokens_alone_and_batched(engines):
    suffix = _engine({"method": "suffix", "num_speculative_tokens": 16, "learn_step_costs": False})
    for prompts in ([PROMPTS[0]], PROMPTS):
        assert _tokens(suffix, prompts, GREEDY) == _tokens(engines[False], prompts, GREEDY)
    speculator = suffix.scheduler._speculator
    assert speculator.counters.num_accepted_tokens > 20 and len(speculator.suffix.cache) == 4


def test_a_cached_prefix_changes_no_token(engines):
    first = _tokens(engines[True], [PROMPTS[0]], GREEDY)
    hits = engines[True].block_manager.prefix_cache_hits
    again = _tokens(engines[True], [PROMPTS[0]], GREEDY)  # its prompt and output blocks are cached now
    assert engines[True].block_manager.prefix_cache_hits > hits
    assert first == again == _tokens(engines[False], [PROMPTS[0]], GREEDY)


def test_preempted_requests_resume_with_the_same_tokens():
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    small = {"num_blocks": 12, "max_num_batched_tokens": 64}
    on, off = _engine(NGRAM, **small), _engine(None, **small)
    assert _tokens(on, PROMPTS, params) == _tokens(off, PROMPTS, params)
    assert on.scheduler.stats().num_preemptions_total > 0
    assert on.scheduler._speculator.counters.num_accepted_tokens > 0


def test_a_seeded_sampled_request_gives_the_same_tokens_and_logprobs(engines):
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.1)
    on = engines[True].generate([PROMPTS[0]], params)[0]
    off = engines[False].generate([PROMPTS[0]], params)[0]
    assert on.token_ids == off.token_ids
