"""Block copies for copy-on-write: before a request writes into a block it shares with another
request, the kvstore gives it a fresh block and asks the worker to copy the shared one there.

A block id names the same rows in every layer (see kv_pool.py), so one pair copies K and V of
that block in every layer's tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy block src -> dst (K and V) in every layer, for each (src, dst) in pairs.

    All copies read the blocks as they were before the call (gather, then scatter), so a
    block may be both a source and, for another pair, a destination. Two pairs writing the
    same destination would make the result depend on the order, hence a ValueError.
    """
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
