"""A GGUF's Q4_1 (weight = d * q + m) and Q8_0 (d * q) tensors per 32 weights, by canonical name
(q [N, K], d/m float32 [N, K/32], Q/K rows unpermuted), and their packed few-row kernel layouts."""

from __future__ import annotations

import os

import numpy as np
import torch

from pagedserve.services.gpu_worker.model.weights import _canonical_gguf_name, unpermute_if_rope_rows
from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_reader import open_gguf
from pagedserve.shared.model_source import find_gguf_in_dir, resolve_model

BLOCK = 32  # weights per block, both types
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34


def _tensors(path_or_name: str, type_name: str, block_bytes: int):
    """(canonical name, number of columns, raw blocks uint8 [rows, K/32, block bytes]) per tensor."""
    import gguf

    path = resolve_model(path_or_name)
    if os.path.isdir(path):
        path = find_gguf_in_dir(path)
    if not path:
        return
    wanted = getattr(gguf.GGMLQuantizationType, type_name)
    for tensor in open_gguf(path).tensors:
        if tensor.tensor_type == wanted:
            num_cols = int(tensor.shape[0])  # GGUF shapes list the fastest dimension first
            raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, num_cols // BLOCK, block_bytes)
            yield _canonical_gguf_name(tensor.name), num_cols, raw


def _fp16(raw: np.ndarray, offset: int) -> np.ndarray:
    return raw[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _as_state_rows(name: str, arrays: tuple, config: ModelConfig) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.ascontiguousarray(unpermute_if_rope_rows(name, a, config))) for a in arrays)


def load_q4_1(path_or_name: str, config: ModelConfig) -> dict[str, tuple[torch.Tensor, ...]]:
    blocks = {}
    for name, num_cols, raw in _tensors(path_or_name, "Q4_1", Q4_1_BLOCK_BYTES):
        packed = raw[..., 4:]
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(raw.shape[0], num_cols)
        blocks[name] = _as_state_rows(name, (q, _fp16(raw, 0), _fp16(raw, 2)), config)
    return blocks


def load_q8_0(path_or_name: str, config: ModelConfig) -> dict[str, tuple[torch.Tensor, ...]]:
    blocks = {}
    for name, num_cols, raw in _tensors(path_or_name, "Q8_0", Q8_0_BLOCK_BYTES):
        q = raw[..., 2:].copy().view(np.int8).reshape(raw.shape[0], num_cols)
        blocks[name] = _as_state_rows(name, (q, _fp16(raw, 0)), config)
    return blocks


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K]: d * q + m (Q4_1) or d * q (Q8_0), as the GGUF loader computes it."""
    w = d.repeat_interleave(BLOCK, 1) * q.float()
    return w if m is None else w + m.repeat_interleave(BLOCK, 1)


def concat(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nibbles uint8 [N/16, K/2, 16] (q[n_i, 2j] | q[n_i, 2j+1] << 4) and dm int16 (fp16 bits)
    [N/16, K/32, 2, 16]; N a multiple of 16, K of 32."""
    num_rows, num_cols = q.shape
    if num_rows % 16 or num_cols % BLOCK or d.shape != (num_rows, num_cols // BLOCK) or m.shape != d.shape:
        raise ValueError(f"Q4_1 blocks of a [{num_rows}, {num_cols}] weight: N % 16, K % 32, d and m [N, K/32]")
    pairs = q.view(num_rows // 16, 16, num_cols // 2, 2).permute(0, 2, 1, 3)  # [N/16, K/2, 16, 2]
    nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    dm = torch.stack([d.half(), m.half()]).view(2, num_rows // 16, 16, -1).permute(1, 3, 0, 2)
    return nibbles, dm.contiguous().view(torch.int16)


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N/16, K, 16] and d int16 (fp16 bits) [N/16, K/32, 16]; N a multiple of 16, K of 32."""
    num_rows, num_cols = q.shape
    if num_rows % 16 or num_cols % BLOCK or d.shape != (num_rows, num_cols // BLOCK):
        raise ValueError(f"Q8_0 blocks of a [{num_rows}, {num_cols}] weight: N % 16, K % 32, d [N, K/32]")
    packed_q = q.view(num_rows // 16, 16, num_cols).permute(0, 2, 1).contiguous()
    packed_d = d.half().view(num_rows // 16, 16, -1).permute(0, 2, 1).contiguous()
    return packed_q, packed_d.view(torch.int16)
