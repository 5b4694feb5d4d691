"""Counter-based Exp(1) noise for the sampler's race, a pure function of (key, vocab index): a seeded
row's key hashes (seed, position), so its tokens do not depend on the batch, preemption or worker."""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_UNIFORM_BITS = 23  # u = (h >> 9 + 0.5) / 2**23 is exact in float32 and strictly inside (0, 1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, without overflowing int64."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_key(seed: int, position: int) -> int:
    """The 64-bit key of a seeded request's token at `position` (0-based in prompt + output)."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))


def random_keys(num_rows: int) -> list[int]:
    return torch.randint(0, 2**62, (num_rows,), dtype=torch.int64).tolist()


def exponential_noise(keys: list[int], vocab_size: int, device) -> torch.Tensor:
    """[len(keys), vocab_size] float32 samples of Exp(1), a pure function of (key, index)."""
    key = torch.tensor([[k & _MASK32, (k >> 32) & _MASK32] for k in keys], dtype=torch.int64, device=device)
    index = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0)
    h = _mix32(_mix32(index ^ key[:, :1]) ^ key[:, 1:])
    u = ((h >> (32 - _UNIFORM_BITS)).float() + 0.5) * (1.0 / (1 << _UNIFORM_BITS))
    return -torch.log(u)
