"""Tier fills (StepPlan.tier_fills), planned before the kvstore knew their last token (async scheduling):
hashed here from the parent hash once full (a rejected draft may delay it); dropped with their request."""

from __future__ import annotations

from pagedserve.shared.block_hash import hash_block
from pagedserve.shared.messages import StepPlan


class TierFills:
    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._waiting: list[tuple[str, int, bytes]] = []  # (request id, block index, parent hash)

    def __len__(self) -> int:
        return len(self._waiting)

    def take_full(self, requests: dict, plan: StepPlan) -> list[tuple[str, int, bytes, int]]:
        """After the plan's step ran: (request id, block index, hash, pool block id) of each fill now full."""
        if plan.reset:
            self._waiting.clear()
        self._waiting += plan.tier_fills
        full, waiting = [], []
        for request_id, index, parent in self._waiting:
            state = requests.get(request_id)
            if state is None or index >= len(state.block_ids):
                continue
            end = (index + 1) * self.block_size
            if state.num_computed_tokens < end or len(state.token_ids) < end:
                waiting.append((request_id, index, parent))
                continue
            block_hash = hash_block(parent, state.token_ids[end - self.block_size:end])
            full.append((request_id, index, block_hash, state.block_ids[index]))
        self._waiting = waiting
        return full
