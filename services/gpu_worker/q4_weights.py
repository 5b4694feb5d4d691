"""A GGUF's Q4_1 projections as they are stored, for the few-row kernel (cpu_gemv.cpp).

A Q4_1 block holds 32 weights of one row: fp16 d, fp16 m, then 16 bytes of 4-bit q (byte i:
weight i in its low nibble, weight 16 + i in its high one); weight = d * q + m. The loader
dequantizes these to the float32 state dict (what HF transformers computes too); the bf16
model rounds them to bf16. The few-row kernel reads q, d and m instead: 0.625 bytes a
weight instead of 2 (SmolLM2's layers: 66 MB instead of 212), and the weights it multiplies
by are the exact GGUF values, not their bf16 roundings.

load_q4_1 returns, by canonical name, (q uint8 [N, K], d float32 [N, K/32], m float32
[N, K/32]) with the Q/K rows unpermuted as the state dict's are; {} for a model that is not
a GGUF or has no Q4_1 tensor.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from services.gpu_worker.weights import _canonical_gguf_name, _unpermute_rope_rows, find_gguf_in_dir, resolve_model

Q4_1_BLOCK = 32
Q4_1_BLOCK_BYTES = 20


def load_q4_1(path_or_name: str, num_heads: int, num_kv_heads: int) -> dict[str, tuple[torch.Tensor, ...]]:
    import gguf

    path = resolve_model(path_or_name)
    if os.path.isdir(path):
        path = find_gguf_in_dir(path)
    if not path:
        return {}
    blocks: dict[str, tuple[torch.Tensor, ...]] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        name = _canonical_gguf_name(tensor.name)
        num_cols = int(tensor.shape[0])  # GGUF shapes list the fastest dimension first
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, num_cols // Q4_1_BLOCK, Q4_1_BLOCK_BYTES)
        d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = raw[..., 4:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(raw.shape[0], num_cols)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
            q, d, m = (_unpermute_rope_rows(a, heads) for a in (q, d, m))
        blocks[name] = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, d, m))
    return blocks


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: d * q + m, as the GGUF loader computes it."""
    return d.repeat_interleave(Q4_1_BLOCK, 1) * q.float() + m.repeat_interleave(Q4_1_BLOCK, 1)


def concat(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Several projections' blocks stacked along N (the fused qkv and gate_up)."""
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))
