"""Free blocks, least recently freed first, linked through the blocks for O(1) removal from the
middle (a prefix hit). Invariant: a block is queued exactly when prev_free is not None."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagedserve.services.kvstore.block import KVBlock


class FreeQueue:
    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)  # sentinel before the first free block
        self._tail = KVBlock(-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        """The block free the longest; IndexError if none is free."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        if block in self:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        """Take a block out wherever it is (a prefix hit on a free cached block)."""
        if block not in self:
            raise ValueError(f"{block!r} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = None
        block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]

    def check_integrity(self) -> None:
        """AssertionError with a reason if the links, the count or membership disagree."""
        seen: set[int] = set()
        prev, block = self._head, self._head.next_free
        while block is not self._tail:
            assert block is not None, "free queue is broken: a link is None before the tail"
            assert block.block_id not in seen, f"block {block.block_id} is twice in the free queue"
            assert block.prev_free is prev, f"block {block.block_id} has a wrong back link"
            assert len(seen) < self.num_free, f"free queue holds more than num_free={self.num_free}"
            seen.add(block.block_id)
            prev, block = block, block.next_free
        assert self._tail.prev_free is prev, "free queue tail sentinel has a wrong back link"
        assert len(seen) == self.num_free, f"free queue holds {len(seen)} blocks, num_free={self.num_free}"
