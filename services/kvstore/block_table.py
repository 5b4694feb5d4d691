"""One request's block table: its blocks in logical order and how many token slots it uses.

Invariants (BlockManager.check_integrity):
- len(blocks) == ceil(num_tokens / block_size): a new block only when the last one is full;
- blocks[:num_hashed_blocks] have been offered to the pool's hash table, and
  num_hashed_blocks <= min(num_tokens // block_size, len(block_hashes)): only full blocks
  whose tokens are known are ever hashed, so a partial last block is never shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kvstore.block import KVBlock


@dataclass
class BlockTable:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # token slots covered: computed, or being computed this step
    # chained hashes of the request's known full blocks (empty without prefix caching);
    # blocks filled by tokens generated after admission are unknown here and stay unhashed
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)
