"""Every supported family (tiny random transformers checkpoints from HF folders) through the
in-process engine, float32 greedy: the same 32 tokens as transformers for 4 prompts sharing a
prefix, run alone, batched with prefix caching, and through a pool small enough to preempt;
and from the GGUF the `gguf` package writes of it (Q8_0), batched with prefix caching and preempted."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.engine import Engine
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams
from tests.gpu_worker.family_checkpoints import (
    FAMILIES,
    GGUF_FAMILIES,
    VOCAB,
    gguf_checkpoint,
    hf_checkpoint,
    hf_greedy,
    save_checkpoint,
)
from tests.gpu_worker.family_gguf import write_gguf

MAX_NEW_TOKENS = 32
pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    stem = torch.randint(3, VOCAB, (13,), generator=gen).tolist()  # 3 full blocks of 4, shared
    return [stem + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (6, 14, 21, 29)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(HF folder, the 4 prompts, transformers' greedy tokens for each)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(request.param, directory)
    prompts = _prompts()
    return str(directory), prompts, [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]


def _engine(directory: str, **overrides) -> Engine:
    config = dict(model=directory, dtype="float32", block_size=4, num_blocks=128, max_num_batched_tokens=32)
    return Engine(EngineConfig(**{**config, **overrides}))


def test_alone_matches_transformers(family):
    directory, prompts, expected = family
    engine = _engine(directory, enable_prefix_caching=False)
    for prompt, tokens in zip(prompts, expected, strict=True):
        (out,) = engine.generate([prompt], GREEDY)
        assert out.token_ids == tokens
    engine.block_manager.check_integrity()


def test_batched_with_prefix_caching_matches_transformers(family):
    directory, prompts, expected = family
    engine = _engine(directory)
    first = engine.generate(prompts, GREEDY)  # batched; chunked prefill (32-token budget)
    again = engine.generate(prompts, GREEDY)  # every stem and prompt block now cached
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert min(o.num_cached_tokens for o in again) >= 12
    assert engine.block_manager.stats()["prefix_cache_hits"] > 0
    engine.block_manager.check_integrity()


def test_preempted_requests_match_transformers(family):
    directory, prompts, expected = family
    # each request ends holding 10-16 blocks of 4: 24 blocks cannot hold the 4 together
    engine = _engine(directory, num_blocks=24)
    outputs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.stats().num_preemptions_total >= 1
    assert [o.token_ids for o in outputs] == expected
    assert engine.block_manager.stats()["num_held_blocks"] == 0
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_batched_with_prefix_caching_and_preempted_matches_transformers(tmp_path, name):
    hf_model = gguf_checkpoint(name)
    path = tmp_path / f"{name}.gguf"
    hf_model.load_state_dict(write_gguf(hf_model, path, "Q8_0"), strict=False)  # the weights it holds
    prompts = _prompts()
    expected = [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    engine = _engine(str(path))
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    engine.block_manager.check_integrity()
    engine = _engine(str(path), num_blocks=24)  # as test_preempted_requests_match_transformers
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert engine.scheduler.stats().num_preemptions_total >= 1
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("type_name", ["Q4_K_M", "Q5_K"])
def test_k_quant_gguf_batched_with_prefix_caching_matches_transformers(tmp_path, type_name):
    """gguf cannot write K-quants: the file holds random K blocks and transformers their values."""
    hf_model = hf_checkpoint("llama3", hidden_size=256, intermediate_size=512, head_dim=64)  # 256-weight blocks
    path = tmp_path / f"llama3-{type_name}.gguf"
    hf_model.load_state_dict(write_gguf(hf_model, path, type_name), strict=False)
    prompts = _prompts()
    engine = _engine(str(path))
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, MAX_NEW_TOKENS) for p in prompts]
    engine.block_manager.check_integrity()
