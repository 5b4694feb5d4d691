"""The real model (SmolLM2, float32) with prefix caching on and off: greedy outputs are the
same token for token, also when a request hits a prefix another request is still
extending, when requests are preempted and resumed (hashed once, by the engine, never by the
block manager), and for n > 1, where each seeded sequence equals what its seed (seed + index) gives alone."""

from __future__ import annotations

import pytest

from pagedserve.services.engine import Engine
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams

pytestmark = pytest.mark.slow

STEM = ("You are a careful assistant. Answer briefly and precisely, in plain words, without lists. "
        "The user asks about geography, cooking and small programs. ")
QUESTIONS = ["What is the capital of Italy?", "How long should an egg boil?", "What does a for loop do?"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(STEM + question) for question in QUESTIONS]


def _engine(prefix: bool, **overrides) -> Engine:
    config = dict(dtype="float32", num_blocks=64, enable_prefix_caching=prefix, max_num_batched_tokens=24)
    return Engine(EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def engines() -> dict[bool, Engine]:
    return {True: _engine(True), False: _engine(False)}


def _run_staggered(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """The first prompt starts alone; the others arrive while it still prefills in chunks."""
    outputs: dict[str, list[int]] = {}
    ids = [engine.add_request(prompts[0], GREEDY)]
    engine.step()  # 24 of its ~40 prompt tokens: it is still extending its prefix
    ids += [engine.add_request(p, GREEDY) for p in prompts[1:]]
    cached = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            cached[delta.request_id] = delta.num_cached_tokens
    return {"tokens": [outputs[i] for i in ids], "cached": [cached[i] for i in ids]}


def test_a_prefix_another_request_is_still_extending_changes_no_token(engines, prompts):
    on, off = _run_staggered(engines[True], prompts), _run_staggered(engines[False], prompts)
    assert on["tokens"] == off["tokens"]
    assert off["cached"] == [0, 0, 0]
    assert min(on["cached"][1:]) >= 16  # the later ones start after a block of the shared stem
    engines[True].block_manager.check_integrity()


def test_preempted_and_resumed_requests_change_no_token(engines, prompts, monkeypatch):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reference = [o.token_ids for o in engines[False].generate(prompts, params)]
    for name in ("block_table.hash_block", "block_manager.hash_full_blocks"):  # each request is hashed once
        monkeypatch.setattr(f"pagedserve.services.kvstore.{name}", lambda *a: pytest.fail("the kvstore hashed"))
    # ~36 prompt tokens (2 blocks of shared stem) + 16 out = 4 blocks each: 2 + 3 * 2 > 6
    small = _engine(True, num_blocks=6)
    outputs = small.generate(prompts, params)
    assert small.scheduler.stats().num_preemptions_total >= 1
    assert [o.token_ids for o in outputs] == reference
    stats = small.block_manager.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_held_blocks"] == 0
    small.block_manager.check_integrity()


def test_n_greedy_sequences_equal_one_greedy_request(engines, prompts):
    (alone,) = engines[False].generate([prompts[0]], GREEDY)
    for prefix in (True, False):
        (out,) = engines[prefix].generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True, n=2))
        assert [c.token_ids for c in out.choices] == [alone.token_ids, alone.token_ids]


@pytest.mark.parametrize("prefix", [True, False])
def test_each_of_n_seeded_sequences_equals_its_seed_alone(engines, prompts, prefix):
    engine = engines[prefix]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    copies_before = engine.block_manager.num_block_copies
    (out,) = engine.generate([prompts[1]], SamplingParams(**{**params.__dict__, "n": 3}))
    alone = [engine.generate([prompts[1]], SamplingParams(**{**params.__dict__, "seed": 1234 + i}))[0].token_ids
             for i in range(3)]
    assert [c.token_ids for c in out.choices] == alone
    assert len({tuple(t) for t in alone}) > 1  # the seeds do differ
    # the prompt's partial last block was copied for all but the last child
    assert engine.block_manager.num_block_copies - copies_before == (2 if len(prompts[1]) % 16 != 1 else 0)
    engine.block_manager.check_integrity()
