"""Random GGUF-like quantized blocks for the few-row kernel tests (d, m: fp16 values as float32)."""

from __future__ import annotations

import torch


def q4_1_blocks(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(q uint8 [N, K] in 0..15, d, m float32 [N, K/32]), weight = d * q + m."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
    d = (torch.rand(out_features, in_features // 32, generator=gen) * 0.02).half().float()
    m = (-torch.rand(out_features, in_features // 32, generator=gen) * 0.15).half().float()
    return q, d, m


def q8_0_blocks(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(q int8 [N, K] in -128..127, d float32 [N, K/32]), weight = d * q."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    d = (torch.rand(out_features, in_features // 32, generator=gen) * 0.001).half().float()
    return q, d
