"""int8 KV cache rows (`--kv-cache-dtype int8`): per token and KV head, D int8 values then their
bfloat16 scale in 2 more bytes (D even: rotary halves), so one layer's pool is int8 [2, num_blocks, block_size, Hkv, D + 2].

Symmetric: value = q * scale, q in [-127, 127], scale = max|x| / 127 of the row (rounded to bf16
first, then q computed against the rounded scale). A row is quantized on its own when its token
is written: no later token changes it, so a slot is written once and never re-read to requantize,
and copy-on-write, preemption and offload move rows with their scales as plain bytes.
A never-written (zero) row dequantizes to zeros: finite, as masked lanes need."""

from __future__ import annotations

import torch

from pagedserve.shared.config import KV_CACHE_DTYPES

SCALE_BYTES = 2  # one bfloat16 per (token, KV head) row
QMAX = 127
_TINY = 1e-30  # the smallest scale: an all-zero row stays zeros, never 0 / 0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type: the model's for "auto", int8 for "int8"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, KV head) row of a pool of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    return kv_cache.shape[-1] - SCALE_BYTES if is_quantized(kv_cache) else kv_cache.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + 2]: values, then the bf16 scale's bytes."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / QMAX).clamp_min(_TINY).to(torch.bfloat16)
    q = torch.round(xf / scale.float()).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 2] -> float32 scales [..., 1]."""
    return rows[..., -SCALE_BYTES:].view(torch.bfloat16).float()


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + 2] -> [..., D] of dtype."""
    return (rows[..., :-SCALE_BYTES].float() * scales(rows)).to(dtype)


def to_cache(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """New K or V rows [T, Hkv, D] in the pool's storage format (the one write path for all backends)."""
    return quantize(x) if is_quantized(kv_cache) else x.to(kv_cache.dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows in `dtype` with the head dim of the model (dequantized if int8)."""
    return dequantize(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
