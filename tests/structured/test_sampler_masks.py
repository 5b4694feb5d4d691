"""The sampler applies a step's grammar masks itself: with the C++ kernel the race reads a random
row's bitmask and visits only its allowed tokens, torch reads the masked logits of greedy rows and of
rows that want logprobs, and without the kernel every masked row is masked up front. Each way gives
exactly the tokens and logprobs of sampling logits masked by hand."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest
import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.sampling.grammar import apply_bitmask
from pagedserve.services.gpu_worker.sampling.sampler import sample
from pagedserve.shared.messages import SamplingParams
from tests.gpu_worker.test_sample_race import _allowed, _bitmask

VOCAB = 1000
PARAMS = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.8, top_p=0.9, seed=2), SamplingParams(temperature=1.0, logprobs=2, seed=3),
          SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.0, logprobs=1),
          SamplingParams(temperature=1.2, top_k=5, repetition_penalty=1.3, seed=5)]
MASKED = [0, 1, 2, 3, 5, 6]  # row 4 is unconstrained


def _masks(bitmask: torch.Tensor, rows: list[int]) -> Future:
    future = Future()
    future.set_result((bitmask, rows))
    return future


def _run(logits, masks=None):
    n = len(PARAMS)
    out = sample(logits.clone(), PARAMS, [f"r{i}" for i in range(n)], [[7, 8, 9]] * n, [2] * n, masks)
    return [(t.token_id, t.logprob, t.top_logprobs) for t in out]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_masks_in_the_sampler_are_masked_logits_sampled(kernel, monkeypatch):
    if kernel and cpu_extensions.load("sample") is None:
        pytest.skip("the C++ kernels could not be built here")
    if not kernel:
        monkeypatch.setattr(cpu_extensions, "load", lambda name: None)
    logits = torch.randn(len(PARAMS), VOCAB, generator=torch.Generator().manual_seed(11)) * 3
    allowed = _allowed(len(PARAMS), VOCAB, seed=11)
    allowed[4] = True
    by_hand = logits.masked_fill(~allowed, -math.inf)
    for step in range(5):
        shifted = logits.roll(step, dims=1)  # other logits each step, the same masks
        expected = _run(shifted.masked_fill(~allowed, -math.inf))
        got = _run(shifted, _masks(_bitmask(allowed), MASKED))
        assert got == expected
        assert all(allowed[i, token] for i, (token, _, _) in enumerate(got))
    top = _run(by_hand)[3][2]  # logprobs are of the masked distribution: its top tokens are allowed ones
    assert len(top) == 2 and all(allowed[3, token] for token, _ in top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_masks_exactly_the_listed_rows(dtype):
    """float32 through the kernel's mask_rows (where built), other dtypes through xgrammar's apply."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)).to(dtype)
    allowed = _allowed(4, VOCAB, seed=3)
    expected = logits.clone()
    expected[[0, 2]] = expected[[0, 2]].masked_fill(~allowed[[0, 2]], -math.inf)
    assert torch.equal(apply_bitmask(logits.clone(), _bitmask(allowed), [0, 2]), expected)
