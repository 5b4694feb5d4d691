"""One request's block table: its blocks in logical order, how many token slots it uses,
and (with prefix caching) the chained hashes of the full blocks whose tokens it knows.

Token ids reach the kvstore as diffs: all of them when a request is admitted, then each
step the tokens that step computes (a decode's one token). add_known_tokens() hashes a
block the moment its known tokens fill it, once, so blocks of generated tokens are
shareable too and a preempted request's recompute is mostly a hit.

Invariants (BlockManager.check_integrity):
- len(blocks) == ceil(num_tokens / block_size): a new block only when the last one is full;
- blocks[:num_hashed_blocks] have been offered to the pool's hash table, and
  num_hashed_blocks <= min(num_tokens // block_size, len(block_hashes)): only full blocks
  whose tokens are known are ever hashed, so a partial last block is never shared;
- a partial last block is shared only between fresh forks (is_fresh_fork): the first
  grant to a fork copies it on write, so nobody ever writes into a block another reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.kvstore.block import KVBlock
from services.kvstore.block_hash import ROOT_HASH, hash_block


@dataclass
class BlockTable:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # token slots covered: computed, or being computed this step
    # chained hashes of the request's known full blocks (empty without prefix caching)
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    root: bytes = ROOT_HASH  # parent of the first block: the model and the cache salt
    # known tokens after the last full known block (fewer than block_size); None once a
    # gap in the tokens it was told makes further hashing impossible (or caching is off)
    tail_token_ids: list[int] | None = None
    # forked and not granted a step yet: its next result lists the whole table (the
    # worker has never seen this request), and its shared partial block is copied on write
    is_fresh_fork: bool = False

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def num_known_tokens(self, block_size: int) -> int:
        return len(self.block_hashes) * block_size + len(self.tail_token_ids or ())

    def add_known_tokens(self, start: int, token_ids: list[int], block_size: int) -> None:
        """token_ids sit at positions start, start + 1, ...; those past the known ones are
        appended and every block they fill is hashed. A gap stops tracking for good."""
        if self.tail_token_ids is None or not token_ids:
            return
        known = self.num_known_tokens(block_size)
        if start > known:
            self.tail_token_ids = None
            return
        self.tail_token_ids.extend(token_ids[known - start:])
        while len(self.tail_token_ids) >= block_size:
            parent = self.block_hashes[-1] if self.block_hashes else self.root
            self.block_hashes.append(hash_block(parent, self.tail_token_ids[:block_size]))
            del self.tail_token_ids[:block_size]

    def fork(self) -> BlockTable:
        """A copy for a forked child: same blocks (the caller adds the references), same
        known tokens, fresh."""
        tail = list(self.tail_token_ids) if self.tail_token_ids is not None else None
        return BlockTable(list(self.blocks), self.num_tokens, list(self.block_hashes), self.num_hashed_blocks,
                          self.root, tail, is_fresh_fork=True)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)
