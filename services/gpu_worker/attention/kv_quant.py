"""int8 KV cache rows (`--kv-cache-dtype int8`): per token and KV head, D int8 values in groups of
GROUP = 32 along head_dim (one group where D is not a multiple of 32), each group with its own scale,
the scales packed after the values: one layer's pool is int8 [2, num_blocks, block_size, Hkv, D + S].

The groups are llama.cpp q8_0's (32 values and a scale): one scale per row lets a few outlier
channels of K (RoPE's low-frequency pairs) set the step of all 64 values. A group's scale is
max|x| / 127 rounded UP to 12 bits of float32 (its 8 exponent bits and top 4 mantissa bits; the
sign, always 0, is dropped), so no value clips and two scales pack in 3 bytes (little-endian: bits 0-11
the even group's, 12-23 the odd one's): S = 3 * ceil(groups / 2), 3 bytes for D = 64 (67 a row,
1.91x the rows of bf16 in the same memory), 6 for D = 128. A 12-bit scale loses at most 1/16 of
a step to a bf16 one; a fourth byte would take D = 64 to 1.88x.

Symmetric: value = q * scale, q in [-127, 127], q = round(x / scale) against the stored scale.
A row is quantized on its own when its token is written: no later token changes it, so a slot
is written once and never re-read, and copy-on-write, preemption and offload move rows with their
scales as plain bytes. A never-written (zero) row dequantizes to zeros: finite, as masked lanes need."""

from __future__ import annotations

import torch

from pagedserve.shared.config import KV_CACHE_DTYPES

GROUP = 32  # values per scale along head_dim (q8_0's block), where D allows
QMAX = 127
SCALE_BITS = 12
_SHIFT = 31 - SCALE_BITS  # a scale's 12 bits are its float32 bits 19-30 (bit 31, the sign, is 0)
_MIN_BITS = 1 << 4  # the smallest 12-bit scale: exponent 1 (2**-126); zero rows stay zeros


def group_size(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def scale_bytes(head_dim: int) -> int:
    """Bytes of packed 12-bit scales after a row's head_dim values (a pair per 3 bytes)."""
    groups = head_dim // group_size(head_dim)
    return 3 * ((groups + 1) // 2)


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
    return head_dim + scale_bytes(head_dim) if dtype == torch.int8 else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    return _head_dim(kv_cache.shape[-1]) if is_quantized(kv_cache) else kv_cache.shape[-1]


def _head_dim(width: int) -> int:
    """The head_dim whose int8 rows are `width` wide; where two fit (99 and 96 both make 102), the one
    in groups of 32."""
    fits = [width - 3 * k for k in range(1, width // 3 + 1) if scale_bytes(width - 3 * k) == 3 * k]
    if not fits:
        raise ValueError(f"no head_dim has int8 rows {width} wide")
    return next((d for d in fits if d % GROUP == 0), fits[0])


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + S]: values, then the packed group scales."""
    d = x.shape[-1]
    g = group_size(d)
    xf = x.float().reshape(*x.shape[:-1], d // g, g)
    bits = (xf.abs().amax(-1) / QMAX).view(torch.int32)  # [..., groups], >= 0
    bits = ((bits + (1 << _SHIFT) - 1) >> _SHIFT).clamp_min(_MIN_BITS)  # rounded up: max|x| / scale <= 127
    scale = (bits << _SHIFT).view(torch.float32)
    q = torch.round(xf / scale[..., None]).clamp_(-QMAX, QMAX).to(torch.int8).reshape(x.shape)
    if bits.shape[-1] % 2:
        bits = torch.cat([bits, torch.zeros_like(bits[..., :1])], dim=-1)
    pair = bits[..., 0::2] | (bits[..., 1::2] << SCALE_BITS)  # [..., groups / 2], 24 bits each
    packed = torch.stack([pair & 0xFF, (pair >> 8) & 0xFF, (pair >> 16) & 0xFF], dim=-1)
    return torch.cat([q, packed.to(torch.uint8).view(torch.int8).flatten(-2)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + S] -> float32 group scales [..., D / GROUP]."""
    d = _head_dim(rows.shape[-1])
    b = rows[..., d:].view(torch.uint8).to(torch.int32).unflatten(-1, (-1, 3))
    pair = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    bits = torch.stack([pair & 0xFFF, pair >> SCALE_BITS], dim=-1).flatten(-2)[..., : d // group_size(d)]
    return (bits << _SHIFT).view(torch.float32)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows [..., D + S] -> [..., D] of dtype."""
    d = _head_dim(rows.shape[-1])
    g = group_size(d)
    q = rows[..., :d].float().unflatten(-1, (d // g, g))
    return (q * scales(rows)[..., None]).flatten(-2).to(dtype)


def to_cache(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """New K or V rows [T, Hkv, D] in the pool's storage format (the one write path for all backends)."""
    return quantize(x) if is_quantized(kv_cache) else x.to(kv_cache.dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows in `dtype` with the head dim of the model (dequantized if int8)."""
    return dequantize(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
