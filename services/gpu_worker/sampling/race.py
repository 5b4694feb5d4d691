"""The random rows' tokens: temperature, top-k, top-p, min-p, then an exponential race on the
counter-based noise of noise.py, token = argmax(logits / T - log(noise)) over the kept tokens.
The C++ kernel (kernels/cpu_sample.cpp) does a row in one pass and sorts nothing; the torch path here
is the same arithmetic in tensor ops, used where the kernel is not built and as its reference.
"""

from __future__ import annotations

import math

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.sampling.noise import exponential_noise
from pagedserve.shared.messages import SamplingParams

_SIGN = 1 << 63


def signed_keys(keys: list[int]) -> torch.Tensor:
    """64-bit keys as an int64 tensor (two's complement), as the kernel reads them."""
    return torch.tensor([k - 2 * _SIGN if k >= _SIGN else k for k in keys], dtype=torch.int64)


def row_settings(params: list[SamplingParams]):
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    return temperature, top_k, top_p, min_p


def filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V] float32 -> logits / T with the tokens the filters cut at -inf (torch ops)."""
    device, vocab = logits.device, logits.shape[1]
    x = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    if any(0 < p.top_k < vocab for p in params):
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        kth = x.sort(dim=1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        probs_sorted, idx = x.softmax(1).sort(dim=1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs_sorted.cumsum(1) - probs_sorted
        drop_sorted = mass_before >= torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted), -math.inf)
    if any(p.min_p > 0.0 for p in params):
        # p >= min_p * p_max, in logits: x - max >= log(min_p)
        floor = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device)
        x = x.masked_fill(x < x.max(1, keepdim=True).values + floor.unsqueeze(1), -math.inf)
    return x


def torch_race(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> torch.Tensor:
    noise = exponential_noise(keys, logits.shape[1], logits.device)
    return (filtered(logits, params) - noise.log()).argmax(dim=1)


def race_tokens(logits: torch.Tensor, params: list[SamplingParams], keys: list[int],
                bitmask: torch.Tensor | None = None, masked: list[int] = ()) -> torch.Tensor:
    """logits [N, V] float32 of random rows (temperature > 0), a 64-bit noise key per row -> tokens [N].
    bitmask [N, ceil(V / 32)] int32: the grammar masks of the rows listed in masked (the others' rows
    are not read); without the kernel the caller has applied them to logits already."""
    kernel = fused_kernel(logits)
    if kernel is None:
        return torch_race(logits, params, keys)
    if not masked:
        return kernel.sample_rows(logits.float().contiguous(), *row_settings(params), signed_keys(keys))
    flags = torch.zeros(len(params), dtype=torch.bool)
    flags[list(masked)] = True
    return kernel.sample_masked_rows(logits.float().contiguous(), *row_settings(params), signed_keys(keys),
                                     bitmask, flags)


def fused_kernel(logits: torch.Tensor):
    """The C++ sampling kernel for these logits (None: torch ops)."""
    return cpu_extensions.load("sample") if logits.device.type == "cpu" else None
