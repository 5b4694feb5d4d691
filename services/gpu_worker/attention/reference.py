"""Dense float32 attention over contexts gathered token by token (int8 rows dequantized): the tests' reference."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.attention.kv_quant import from_cache, to_cache
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata


class ReferenceBackend:
    name = "reference"

    def write_kv(self, key, value, kv_cache, meta: AttentionMetadata) -> None:
        num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
        flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
        flat[0, meta.slot_mapping] = to_cache(key, kv_cache)
        flat[1, meta.slot_mapping] = to_cache(value, kv_cache)

    def attend(self, query, kv_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        start = 0
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=False)):
            positions = torch.arange(s_len)
            blocks = meta.block_tables[i, positions // block_size].long()
            k = from_cache(kv_cache[0, blocks, positions % block_size], torch.float32)  # [s_len, Hkv, D]
            v = from_cache(kv_cache[1, blocks, positions % block_size], torch.float32)
            k = k.repeat_interleave(group, dim=1)  # [s_len, Hq, D]
            v = v.repeat_interleave(group, dim=1)
            q = query[start : start + q_len].float()  # [q_len, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            q_pos = torch.arange(s_len - q_len, s_len)
            mask = positions[None, :] > q_pos[:, None]  # [q_len, s_len] future keys
            if window is not None:  # and keys that slid out
                mask |= positions[None, :] <= q_pos[:, None] - window
            scores.masked_fill_(mask[None], float("-inf"))
            out[start : start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
            start += q_len
        return out
