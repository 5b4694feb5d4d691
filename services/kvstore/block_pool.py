"""The fixed pool of blocks: free queue (the LRU of cached free blocks), refcounts, prefix-hash table;
the table maps h -> block exactly when block.block_hash == h."""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.services.kvstore.block import KVBlock
from pagedserve.services.kvstore.free_queue import FreeQueue


class BlockPool:
    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # in id order, so the first allocations get 0, 1, 2, ...
        self.free_queue = FreeQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}  # block_hash -> the full block holding it
        self.num_evictions = 0  # cached free blocks reused for something else
        self.num_cached_free_blocks = 0  # free blocks still findable by their hash
        self.record_events = record_events
        self._events: dict[bytes, bool] = {}  # net hash-table diff since take_events()
        self._cleared = False

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_held_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def allocate(self, num_new_blocks: int) -> list[KVBlock]:
        """Pop the blocks free the longest, each now held once; evicts their hashes."""
        if num_new_blocks > len(self.free_queue):
            raise ValueError(f"{num_new_blocks} blocks wanted, {len(self.free_queue)} free")
        new_blocks = []
        for _ in range(num_new_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """One more reference to each (prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free_blocks -= block.block_hash is not None
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in order; at 0 it joins the queue's end (pass tail first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"release of an unreferenced {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self.num_cached_free_blocks += block.block_hash is not None

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full, held block under its hash; False if another block holds that prefix."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.record_events:
            self._events[block_hash] = True
        return True

    def reset_cache(self) -> int:
        """Forget every cached prefix (safe while requests run); how many."""
        num_dropped = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.num_cached_free_blocks = 0
        if self.record_events:
            self._events.clear()
            self._cleared = True
        return num_dropped

    def take_events(self) -> tuple[list[bytes], list[bytes], bool]:
        """(hashes stored, hashes removed, cleared before them) since the last call."""
        events, cleared = self._events, self._cleared
        self._events, self._cleared = {}, False
        return [h for h, stored in events.items() if stored], [h for h, stored in events.items() if not stored], cleared

    def _evict(self, block: KVBlock) -> None:
        del self.cached_blocks[block.block_hash]
        if self.record_events:
            self._events[block.block_hash] = False
        block.block_hash = None
        self.num_evictions += 1

    def check_integrity(self) -> None:
        self.free_queue.check_integrity()
        queued_ids = set(self.free_queue.block_ids())
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in queued_ids
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id} ref_cnt={block.ref_cnt} but in_free_queue={in_queue}")
            assert in_queue == (block in self.free_queue), (
                f"block {block.block_id} has free-queue links but is not in the queue, or the reverse")
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash the hash table does not map to it")
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, (
                f"hash table entry {block_hash.hex()[:8]} points to block {block.block_id} "
                f"whose block_hash is {block.block_hash!r}")
        num_cached_free = sum(block.ref_cnt == 0 and block.block_hash is not None for block in self.blocks)
        assert num_cached_free == self.num_cached_free_blocks, (
            f"{num_cached_free} free blocks carry a hash but num_cached_free_blocks={self.num_cached_free_blocks}")
        num_ref0 = sum(block.ref_cnt == 0 for block in self.blocks)
        assert num_ref0 == len(self.free_queue), (
            f"{num_ref0} blocks have ref_cnt 0 but the free queue holds {len(self.free_queue)}")
