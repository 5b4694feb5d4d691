"""Paged attention with a sliding window and/or logit soft-capping (Gemma 2/3), plain torch, float32
scores: each query reads only the keys of its window, gathered slot by slot, so blocks wholly
before every window are never touched. A key at position p is visible to a query at position t
when p <= t and t - p < window (transformers' sliding_window_overlay); soft-capping is
cap * tanh(score / cap), applied before the mask as transformers' eager attention does."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.attention.kv_quant import from_cache
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata


def first_key(seq_len: int, query_len: int, window: int | None) -> int:
    """The first position any of the request's queries reads (0 without a window)."""
    return 0 if window is None else max(0, seq_len - query_len - window + 1)


def attend_windowed(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """query [T, H, D] -> [T, H, D]; decodes (query_len 1) in one batched pass, prefills one by one."""
    out = torch.empty_like(query)
    starts = [0]
    for q_len in meta.query_lens_cpu:
        starts.append(starts[-1] + q_len)
    decodes = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    if decodes:
        _decodes(out, query, kv_cache, meta, decodes, [starts[i] for i in decodes], scale, window, softcap)
    for i, q_len in enumerate(meta.query_lens_cpu):
        if q_len > 1:
            _prefill(out, query, kv_cache, meta, i, starts[i], scale, window, softcap)
    return out


def _gather(kv_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V float32 [..., Hkv, D] at positions [...] of block table rows tables [..., max_blocks]."""
    block_size = kv_cache.shape[2]
    blocks = torch.gather(tables, -1, positions // block_size).long()
    offsets = positions % block_size
    return (from_cache(kv_cache[0, blocks, offsets], torch.float32),
            from_cache(kv_cache[1, blocks, offsets], torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None, visible: torch.Tensor):
    """q [..., Hkv, G, Q, D], k [..., K, Hkv, D], visible bool [..., 1, 1, Q, K] -> probabilities."""
    scores = torch.einsum("...hgqd,...khd->...hgqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


def _decodes(out, query, kv_cache, meta, rows: list[int], token_idx: list[int], scale, window, softcap) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    device = query.device
    seq_lens = torch.tensor([meta.seq_lens_cpu[i] for i in rows], dtype=torch.int64, device=device)
    firsts = torch.tensor([first_key(meta.seq_lens_cpu[i], 1, window) for i in rows], dtype=torch.int64,
                          device=device)
    width = int((seq_lens - firsts).max())
    positions = firsts[:, None] + torch.arange(width, device=device)[None, :]  # [R, W]
    visible = positions < seq_lens[:, None]
    tables = meta.block_tables.index_select(0, torch.tensor(rows, device=meta.block_tables.device)).to(device)
    k, v = _gather(kv_cache, tables.long(), torch.where(visible, positions, firsts[:, None]))  # [R, W, Hkv, D]
    idx = torch.tensor(token_idx, dtype=torch.int64, device=device)
    q = query.index_select(0, idx).float().view(len(rows), num_kv_heads, -1, 1, head_dim)
    probs = _scores(q, k, scale, softcap, visible[:, None, None, None, :])  # [R, Hkv, G, 1, W]
    o = torch.einsum("rhgqk,rkhd->rqhgd", probs, v).reshape(len(rows), num_heads, head_dim)
    out.index_copy_(0, idx, o.to(query.dtype))


def _prefill(out, query, kv_cache, meta, i: int, start: int, scale, window, softcap) -> None:
    q_len, s_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
    num_heads, head_dim = query.shape[1], query.shape[2]
    device = query.device
    positions = torch.arange(first_key(s_len, q_len, window), s_len, device=device)
    k, v = _gather(kv_cache, meta.block_tables[i].to(device).long(), positions)  # [K, Hkv, D]
    q_pos = torch.arange(s_len - q_len, s_len, device=device)
    visible = positions[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= positions[None, :] > q_pos[:, None] - window
    q = query[start : start + q_len].float().view(q_len, kv_cache.shape[3], -1, head_dim).permute(1, 2, 0, 3)
    probs = _scores(q, k, scale, softcap, visible)  # [Hkv, G, Q, K]
    o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, num_heads, head_dim)
    out[start : start + q_len] = o.to(query.dtype)
