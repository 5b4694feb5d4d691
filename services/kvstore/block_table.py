"""One request's block table. Invariants: len(blocks) == ceil(num_tokens / block_size); only full
known blocks are hashed, so a partial last block is shared only between fresh forks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.services.kvstore.block import KVBlock
from pagedserve.shared.block_hash import ROOT_HASH, hash_block


@dataclass
class BlockTable:
    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0  # token slots covered: computed, or being computed this step
    # chained hashes of the request's known full blocks (empty without prefix caching)
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    root: bytes = ROOT_HASH  # parent of the first block: the model and the cache salt
    # known tokens after the last full known block; None once a gap stops hashing (or caching is off)
    tail_token_ids: list[int] | None = None
    # forked, no step granted yet: its next result lists the whole table
    is_fresh_fork: bool = False

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    def num_known_tokens(self, block_size: int) -> int:
        return len(self.block_hashes) * block_size + len(self.tail_token_ids or ())

    def add_known_tokens(self, start: int, token_ids: list[int], block_size: int,
                         given_hashes: Sequence[bytes] = ()) -> None:
        """token_ids at positions start, ...: new ones appended, filled blocks hashed; a gap stops it.
        given_hashes: the hashes of the blocks they fill, the first block start // block_size's (the
        request's own, computed once by the scheduler); without them the blocks are hashed here."""
        if self.tail_token_ids is None or not token_ids:
            return
        known = self.num_known_tokens(block_size)
        if start > known:
            self.tail_token_ids = None
            return
        self.tail_token_ids.extend(token_ids[known - start:])
        first_given = start // block_size
        while len(self.tail_token_ids) >= block_size:
            index = len(self.block_hashes)
            if 0 <= index - first_given < len(given_hashes):
                self.block_hashes.append(given_hashes[index - first_given])
            else:
                parent = self.block_hashes[-1] if self.block_hashes else self.root
                self.block_hashes.append(hash_block(parent, self.tail_token_ids[:block_size]))
            del self.tail_token_ids[:block_size]

    def fork(self) -> BlockTable:
        """A fresh copy for a forked child (the caller adds the block references)."""
        tail = list(self.tail_token_ids) if self.tail_token_ids is not None else None
        return BlockTable(list(self.blocks), self.num_tokens, list(self.block_hashes), self.num_hashed_blocks,
                          self.root, tail, is_fresh_fork=True)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold num_tokens slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)
