"""Copy-on-write: the worker copies a shared block's K and V into the fresh one, in every layer."""

from __future__ import annotations

import torch


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy src -> dst per pair, all reads before any write; a repeated destination raises ValueError."""
    if not pairs or not kv_caches:
        return
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"copy_blocks: a destination block appears twice in {pairs}")
    num_blocks = kv_caches[0].shape[1]
    for s, d in pairs:
        if not (0 <= s < num_blocks and 0 <= d < num_blocks):
            raise ValueError(f"copy_blocks: pair {(s, d)} outside the pool of {num_blocks} blocks")
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor(dsts, dtype=torch.int64, device=device)
    for layer in kv_caches:
        # index_select makes the copy of all sources first; index_copy_ then scatters it
        layer.index_copy_(1, dst, layer.index_select(1, src))
