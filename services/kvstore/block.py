"""One KV block's bookkeeping; ref_cnt = block-table entries pointing here, 0 exactly when in the
free queue, and block_hash set exactly when the pool's hash table maps it here."""

from __future__ import annotations


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # links owned by FreeQueue; both None while the block is not in the queue
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={hashed})"
