"""Speculative decoding through real processes (kvstore, worker, scheduler over Redis, the scheduler
started with --speculative-config): greedy and seeded tokens equal the in-process engine's without
speculation, alone and batched; the scheduler's stats count drafts and accepted tokens; every block
ends free."""

from __future__ import annotations

import json

import pytest

from pagedserve.shared.messages import SamplingParams
from tests.services.conftest import TestApi, start_backend, wait_for

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [f"Rewrite this code with type hints:\n{CODE}\nAnswer:\n",
           "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"]


@pytest.fixture(scope="module", params=[NGRAM, SUFFIX], ids=["ngram", "suffix"])
def spec_stack(tmp_path_factory, request):
    stack = start_backend(tmp_path_factory.mktemp("spec"),
                          args={"scheduler": ["--speculative-config", json.dumps(request.param)]})
    yield stack
    stack.close()


def test_the_stack_with_speculation_gives_the_engines_tokens(spec_stack, engine_f32, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    api = TestApi(spec_stack)
    kv_before = spec_stack.stats("kvstore") or {}
    try:
        alone = api.wait_finished([api.submit(prompts[0], greedy)], timeout=300.0)[0]
        batch = api.wait_finished([api.submit(p, greedy) for p in prompts] + [api.submit(prompts[0], seeded)],
                                  timeout=300.0)
    finally:
        api.close()
    expected = [o.token_ids for o in engine_f32.generate(prompts, greedy)]
    assert alone.token_ids == expected[0]
    assert [o.token_ids for o in batch[:2]] == expected
    assert batch[2].token_ids == engine_f32.generate([prompts[0]], seeded)[0].token_ids
    assert all(o.finish_reason == "length" for o in [alone, *batch])
    # the stats blob is written a moment after the steps: wait until it counts every token
    stats = wait_for(lambda: (s := spec_stack.stats("scheduler")) and s["generation_tokens_total"] >= 32 * 3 + 24
                     and s, 30.0, "the scheduler's stats to count every token")
    assert stats["spec_decode_num_drafts_total"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] <= stats["spec_decode_num_draft_tokens_total"]
    assert stats["spec_decode_num_accepted_tokens_per_pos_0_total"] > 0
    spec_stack.wait_kvstore_clean(since=kv_before)  # every block back, integrity checked


def test_a_request_that_opts_out_gets_no_drafts(spec_stack, engine_f32, tokenizer):
    prompt = tokenizer.encode(PROMPTS[0])
    off = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, speculative_decoding=False)
    before = wait_for(lambda: spec_stack.stats("scheduler"), 30.0, "the scheduler's stats")
    api = TestApi(spec_stack)
    try:
        out = api.wait_finished([api.submit(prompt, off)], timeout=300.0)[0]
    finally:
        api.close()
    assert out.token_ids == engine_f32.generate([prompt], off)[0].token_ids
    stats = wait_for(lambda: (s := spec_stack.stats("scheduler"))
                     and s["generation_tokens_total"] >= before["generation_tokens_total"] + 32 and s,
                     30.0, "the scheduler's stats to count every token")
    assert stats["spec_decode_num_drafts_total"] == before["spec_decode_num_drafts_total"]
