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
