"""An int8 KV pool under preemption: requests preempted for want of blocks are recomputed into
int8 rows again and end with the tokens of the same int8 engine given a pool that holds them all;
every block is back and the block manager's integrity holds after each step."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.engine import Engine
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain in two sentences why the sky is blue.", "List three fruits that are red."]


def _engine(num_blocks: int) -> Engine:
    # float32 model, as test_engine_hf: bf16 would put near-ties within reach of the recompute order
    return Engine(EngineConfig(dtype="float32", kv_cache_dtype="int8", num_blocks=num_blocks,
                               max_num_batched_tokens=64))


def test_preempted_int8_requests_resume_with_the_same_tokens(tokenizer):
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = _engine(64)
    expected = [o.token_ids for o in roomy.generate(prompts, greedy)]
    assert roomy.block_manager.stats()["num_preemptions"] == 0

    tight = _engine(10)  # each request ends near 5 blocks of 16: two at a time
    assert tight.worker.pool.kv_caches[0].dtype == torch.int8
    got = [o.token_ids for o in tight.generate(prompts, greedy)]
    assert tight.block_manager.stats()["num_preemptions"] > 0
    assert got == expected
    tight.block_manager.check_integrity()
    assert tight.block_manager.num_held_blocks == 0
