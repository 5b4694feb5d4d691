"""The random rows' kernel (kernels/cpu_sample.cpp) against the same arithmetic in torch (race.py):
the noise to float32 ulps, the tokens exactly, every filter alone and together, -inf logits
(a grammar's mask), and rows independent of their batch and of the thread that samples them."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.sampling.noise import exponential_noise, seeded_key
from pagedserve.services.gpu_worker.sampling.race import filtered, race_tokens, row_settings, signed_keys, torch_race
from pagedserve.shared.messages import SamplingParams

kernel = cpu_extensions.load("sample")
needs_kernel = pytest.mark.skipif(kernel is None, reason="the C++ kernels could not be built here")

SETTINGS = [dict(), dict(top_k=7), dict(top_p=0.5), dict(top_p=0.95), dict(min_p=0.05), dict(temperature=0.3),
            dict(temperature=1.7, top_k=300, top_p=0.9, min_p=0.01), dict(top_k=1), dict(top_p=1e-6)]


def _params(rows: int) -> list[SamplingParams]:
    return [SamplingParams(**{"temperature": 1.0, **SETTINGS[i % len(SETTINGS)]}, seed=i) for i in range(rows)]


def _kernel_tokens(logits, params, keys):
    return kernel.sample_rows(logits, *row_settings(params), signed_keys(keys)).tolist()


@needs_kernel
def test_the_kernels_noise_is_the_torch_noise():
    keys = [seeded_key(s, p) for s in (0, 1, 2**40 + 3) for p in (0, 7, 1000)]
    ours = kernel.exponential_noise(signed_keys(keys), 5000)
    torch.testing.assert_close(ours, exponential_noise(keys, 5000, "cpu"), rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("vocab", [50, 5000])
def test_the_kernel_picks_the_torch_token_under_every_filter(vocab):
    # 5000 tokens: top-p's bisection runs (more than its sorted few lie near the cut)
    params = _params(3 * len(SETTINGS))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    for position in range(6):
        keys = [seeded_key(p.seed, position) for p in params]
        assert _kernel_tokens(logits, params, keys) == torch_race(logits, params, keys).tolist()


@needs_kernel
@pytest.mark.parametrize("spread", [0.0, 1.0, 8.0, 40.0])
def test_chunks_the_race_skips_hold_no_winner(spread):
    # 0: every token ties (nothing skipped); 40: a few tokens far ahead (almost every chunk skipped)
    gen = torch.Generator().manual_seed(int(spread))
    logits = torch.randn(48, 49152, generator=gen) * spread
    logits[::3, 12345] += spread  # some rows with one clear favourite, past the first chunks
    params = [SamplingParams(temperature=(0.5, 1.0, 2.0)[i % 3], seed=i) for i in range(48)]
    for position in range(3):
        keys = [seeded_key(p.seed, position) for p in params]
        assert _kernel_tokens(logits, params, keys) == torch_race(logits, params, keys).tolist()


@needs_kernel
def test_masked_tokens_never_win():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    allowed = [3, 500, 999]
    masked = torch.full_like(logits, -math.inf)
    masked[:, allowed] = logits[:, allowed]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in ((1.0, 1.0, 0), (2.0, 0.9, 0),
                                                                               (1.0, 1.0, 2), (0.5, 0.5, 5))]
    for position in range(100):
        keys = [seeded_key(9, position)] * 4
        assert set(_kernel_tokens(masked, params, keys)) <= set(allowed)


@needs_kernel
def test_top_p_keeps_exactly_the_prefix_that_reaches_it():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # descending: 1, 3, 2, 0; mass before 0, .5, .8, .95
    logits = probs.log().repeat(1, 1)
    for top_p, kept in ((0.4, {1}), (0.7, {1, 3}), (0.9, {1, 2, 3}), (1.0, {0, 1, 2, 3})):
        params = [SamplingParams(temperature=1.0, top_p=top_p)]
        seen = {_kernel_tokens(logits, params, [seeded_key(1, n)])[0] for n in range(400)}
        assert seen == kept, top_p
        assert torch.isfinite(filtered(logits, params)[0]).nonzero().flatten().tolist() == sorted(kept)


@needs_kernel
def test_rows_are_independent_of_the_batch_and_its_threads():
    params = _params(64)
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(5)) * 2
    keys = [seeded_key(p.seed, 11) for p in params]
    together = _kernel_tokens(logits, params, keys)
    alone = [_kernel_tokens(logits[i:i + 1], params[i:i + 1], keys[i:i + 1])[0] for i in range(64)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _kernel_tokens(logits, params, keys)
    finally:
        torch.set_num_threads(threads)
    assert together == alone == single


def test_race_tokens_serves_without_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_extensions, "load", lambda name: None)
    params = _params(len(SETTINGS))
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(2))
    keys = [seeded_key(p.seed, 4) for p in params]
    assert race_tokens(logits, params, keys).tolist() == torch_race(logits, params, keys).tolist()


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), position=st.integers(0, 10**6), temperature=st.floats(0.05, 4.0),
       top_k=st.integers(0, 40), top_p=st.floats(0.01, 1.0), min_p=st.floats(0.0, 0.9),
       scale=st.floats(0.1, 20.0), batch_at=st.integers(0, 3))
def test_any_row_picks_a_kept_token_and_the_same_one_in_any_batch(seed, position, temperature, top_k, top_p,
                                                                   min_p, scale, batch_at):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(position % 997)) * scale
    key = seeded_key(seed, position)
    (alone,) = _kernel_tokens(logits[batch_at:batch_at + 1], [p], [key])
    others = [SamplingParams(temperature=1.0, top_p=0.5, seed=1)] * 4
    keys = [seeded_key(1, position)] * 4
    params, keys[batch_at] = others[:batch_at] + [p] + others[batch_at + 1:], key
    assert _kernel_tokens(logits, params, keys)[batch_at] == alone
    assert torch.isfinite(filtered(logits[batch_at:batch_at + 1], [p])[0, alone])


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> the grammar's int32 bitmask [N, ceil(V / 32)] (bit v % 32 of word v / 32)."""
    n, vocab = allowed.shape
    padded = torch.zeros(n, (vocab + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(n, -1, 32) << torch.arange(32)).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _allowed(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of different densities: one token, a few, about half, all but a few."""
    g = torch.Generator().manual_seed(seed)
    density = torch.tensor([1 / vocab, 0.01, 0.5, 0.97] * rows)[:rows].unsqueeze(1)
    allowed = torch.rand(rows, vocab, generator=g) < density
    allowed[torch.arange(rows), torch.randint(vocab, (rows,), generator=g)] = True  # never empty
    return allowed


@needs_kernel
@pytest.mark.parametrize("vocab", [50, 3001])
def test_the_masked_race_picks_the_torch_token_of_the_masked_logits(vocab):
    """V not a multiple of 32: the last word's bits past V are never read."""
    params = _params(2 * len(SETTINGS))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    allowed = _allowed(len(params), vocab, seed=vocab)
    masked_logits = logits.masked_fill(~allowed, -math.inf)
    flags = torch.ones(len(params), dtype=torch.bool)
    for position in range(6):
        keys = [seeded_key(p.seed, position) for p in params]
        tokens = kernel.sample_masked_rows(logits, *row_settings(params), signed_keys(keys), _bitmask(allowed), flags)
        assert tokens.tolist() == torch_race(masked_logits, params, keys).tolist()
        assert allowed[torch.arange(len(params)), tokens].all()


@needs_kernel
def test_a_row_without_its_flag_ignores_its_mask_and_races_as_alone():
    params = _params(6)
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(8))
    allowed = _allowed(6, 700, seed=8)
    keys = [seeded_key(p.seed, 3) for p in params]
    flags = torch.tensor([True, False] * 3)
    mixed = kernel.sample_masked_rows(logits, *row_settings(params), signed_keys(keys), _bitmask(allowed), flags)
    plain = _kernel_tokens(logits, params, keys)
    assert mixed.tolist()[1::2] == plain[1::2]
    assert all(allowed[i, t] for i, t in enumerate(mixed.tolist()) if flags[i])


@needs_kernel
def test_a_mask_whose_tokens_are_all_at_minus_infinity_gives_its_first_allowed_token():
    logits = torch.zeros(1, 100)
    logits[0, 40:] = -math.inf
    allowed = torch.zeros(1, 100, dtype=torch.bool)
    allowed[0, [70, 90]] = True
    params = _params(1)
    tokens = kernel.sample_masked_rows(logits, *row_settings(params), signed_keys([5]), _bitmask(allowed),
                                       torch.ones(1, dtype=torch.bool))
    assert tokens.tolist() == [70]


@needs_kernel
@pytest.mark.parametrize("vocab", [64, 1000])
def test_mask_rows_is_xgrammars_apply(vocab):
    import xgrammar as xgr

    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(4))
    bitmask = _bitmask(_allowed(5, vocab, seed=4))
    ours, theirs = logits.clone(), logits.clone()
    kernel.mask_rows(ours, bitmask, torch.tensor([0, 2, 3]))
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=[0, 2, 3])
    assert torch.equal(ours, theirs) and torch.equal(ours[[1, 4]], logits[[1, 4]])
