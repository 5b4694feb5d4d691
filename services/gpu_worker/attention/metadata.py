"""One step's ragged batch: request i owns tokens [query_start_loc[i], query_start_loc[i+1]);
KV cache per layer [2, num_blocks, block_size, Hkv, D], position p at block_tables[i, p // block_size]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], context length after this step
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], unused entries 0
    slot_mapping: torch.Tensor  # int64 [T], flat slot for each new token's K/V
    max_query_len: int
    max_seq_len: int
    # host copies (python ints), so a CPU path can split the batch without syncing
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @staticmethod
    def positions(meta: AttentionMetadata) -> torch.Tensor:
        """int64 [T]: the position of every new token in its request."""
        q = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
        s = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(len(q)), q)
        starts = torch.cumsum(q, 0) - q  # meta.query_start_loc's values, without a device sync
        return (torch.arange(int(q.sum())) - starts[rows] + (s - q)[rows]).to(meta.slot_mapping.device)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=starts[1:])
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables] or [[0]], dtype=torch.int32)
        # per new token: its request row and its position (new tokens end the context)
        rows = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens_t)
        num_tokens = int(starts[-1])
        positions = torch.arange(num_tokens) - starts[rows] + (seq_lens_t - query_lens_t)[rows]
        slots = table[rows, positions // block_size].long() * block_size + positions % block_size
        return AttentionMetadata(
            query_start_loc=starts.to(torch.int32).to(device),
            seq_lens=seq_lens_t.to(torch.int32).to(device),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store key/value [T, num_kv_heads, head_dim] into kv_cache at meta.slot_mapping."""

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D]; head h reads kv head h // (H // Hkv); keys t - p < window only;
        scores s become softcap * tanh(s / softcap). Call write_kv first."""
