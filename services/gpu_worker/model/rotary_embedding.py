"""Rotary embedding (HF "rotate half"), linear and llama3 scaling (or a GGUF's rope_freqs);
float32 angles as in transformers."""

from __future__ import annotations

import math

import torch

from pagedserve.shared.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """float32 [rotary_dim // 2]: the rotation speed of each dim pair, after rope_scaling."""
    dim = config.rotary_dim
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":  # transformers' own expression
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * config.rope_theta**exponents)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "freq_factors":  # llama.cpp's rope_freqs: theta_i / factor_i
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        angles = positions[:, None] * inv_freq[None, :]  # [max_pos, rotary_dim // 2] float32
        scale = (config.rope_scaling or {}).get("attention_factor", 1.0)  # longrope's
        # the fused kernels turn whole heads: a partial rotary (Phi-4-mini) takes the torch path
        self.full = config.rotary_dim == config.head_dim
        # not persistent: derived from the config, never part of a checkpoint
        self.register_buffer("cos", (angles.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (angles.sin() * scale).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, fused=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T]; query [T, H, D], key [T, Hkv, D] -> rotated (in place when fused)."""
        if fused is not None and self.full:
            fused.rotary(query, positions, self.cos, self.sin)
            fused.rotary(key, positions, self.cos, self.sin)
            return query, key
        cos = self.cos[positions].to(query.dtype)[:, None, :]  # [T, 1, D/2]
        sin = self.sin[positions].to(query.dtype)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half on the first 2 * cos.shape[-1] dims of each head; the rest pass through."""
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)
