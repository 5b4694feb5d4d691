"""Per-request block tables over one worker's BlockPool. Invariant: a block's ref_cnt equals the
number of tables listing it; shared full blocks are never rewritten, a fork's partial one is copied."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pagedserve.services.kvstore.alloc_step import run_step
from pagedserve.services.kvstore.block_pool import BlockPool
from pagedserve.services.kvstore.block_table import BlockTable, num_blocks_for
from pagedserve.services.kvstore.tier_link import TierLink
from pagedserve.shared.block_hash import hash_full_blocks, root_hash
from pagedserve.shared.messages import KEY_BYTES, AllocReply, AllocRequest


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 watermark: float = 0.01, hash_keys: Sequence[str] = (), record_events: bool = False,
                 tier: TierLink | None = None) -> None:
        """hash_keys: what besides tokens makes K/V differ (the model), mixed into every prefix hash;
        tier: the offload tier behind the pool (prefix caching only)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.pool = BlockPool(num_blocks, record_events=record_events)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # admission keeps this many blocks free for running requests to grow into
        self.watermark_blocks = math.ceil(watermark * num_blocks)
        self._tables: dict[str, BlockTable] = {}
        self.num_preemptions = 0
        self.hash_keys = tuple(hash_keys)
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.num_block_copies = 0
        self.num_prefix_cache_resets = 0
        self._block_copies: list[tuple[int, int]] = []  # (src, dst) since take_block_copies()
        self.tier = tier if enable_prefix_caching else None
        self.tier_hits = 0  # of prefix_cache_hits, tokens found in the tier (not in the pool)
        self._tier_loads: dict[str, list[tuple[int, bytes]]] = {}  # admitted this step: blocks to load

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_held_blocks(self) -> int:
        return self.pool.num_held_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_held_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return table.block_ids if table is not None else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def num_blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        table = self._tables.get(request_id)
        num_held = len(table.blocks) if table is not None else 0
        return max(0, num_blocks_for(num_total_tokens, self.block_size) - num_held)

    def can_allocate(self, request_id: str, num_new_tokens: int) -> bool:
        table = self._tables.get(request_id)
        num_total_tokens = (table.num_tokens if table is not None else 0) + num_new_tokens
        num_copies = int(num_new_tokens > 0 and table is not None and self._must_copy_last_block(table))
        return self.num_blocks_needed(request_id, num_total_tokens) + num_copies <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_new_tokens: int, token_ids: Sequence[int] = (),
                       token_ids_start: int = -1, block_hashes: Sequence[bytes] = ()) -> list[int] | None:
        """New block ids, or None (no change) if too few are free; token_ids start at
        token_ids_start (-1: the new slots) and may lag the slots but never leave a gap;
        block_hashes: those of the blocks they fill (BlockTable.add_known_tokens)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        # can_allocate() inlined: this runs once per running request per step
        table = self._tables.get(request_id)
        num_tokens = num_new_tokens + (table.num_tokens if table is not None else 0)
        copy = num_new_tokens > 0 and table is not None and self._must_copy_last_block(table)
        num_new_blocks = max(0, num_blocks_for(num_tokens, self.block_size) - (len(table.blocks) if table else 0))
        if num_new_blocks + copy > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._tables[request_id] = self._new_table()
        if num_new_tokens > 0:
            if copy:
                self._copy_last_block(table)
            table.is_fresh_fork = False
        start = table.num_tokens if token_ids_start < 0 else token_ids_start
        table.num_tokens = num_tokens
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks else []
        table.blocks.extend(new_blocks)
        if token_ids:
            table.add_known_tokens(start, list(token_ids), self.block_size,
                                   block_hashes if token_ids_start >= 0 else ())
        if self.tier is not None or table.num_hashed_blocks < len(table.block_hashes):
            self._cache_full_blocks(request_id, table)
        return [block.block_id for block in new_blocks]

    def admit(self, request_id: str, num_tokens: int, num_new_tokens: int, token_ids: Sequence[int] = (),
              cache_salt: str = "", block_hashes: Sequence[bytes] = ()) -> tuple[list[int], int] | None:
        """(block ids, num_cached_tokens) or None unless all num_tokens plus the watermark fit
        (waived when the pool is empty); the last token is always left to compute. block_hashes:
        those of token_ids' full blocks, computed once by the scheduler (else hashed here)."""
        if num_tokens < 1 or num_new_tokens < 0:
            raise ValueError(f"admit {request_id!r}: num_tokens={num_tokens}, num_new_tokens={num_new_tokens}")
        if token_ids and len(token_ids) != num_tokens:
            raise ValueError(f"admit {request_id!r}: {len(token_ids)} token ids for num_tokens={num_tokens}")
        self.free(request_id)  # a waiting request holds nothing; a stale table is dropped
        table = self._new_table(cache_salt)
        if self.enable_prefix_caching and token_ids:
            table.block_hashes = list(block_hashes) or hash_full_blocks(token_ids, self.block_size, table.root)
            table.tail_token_ids = list(token_ids[len(table.block_hashes) * self.block_size:])
        block_hashes = table.block_hashes
        hit_blocks = []
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        tier_hashes = block_hashes[len(hit_blocks): (num_tokens - 1) // self.block_size] if self.tier else []
        tier_hashes = tier_hashes[: self.tier.num_hits(tier_hashes)] if tier_hashes else []
        num_free_after_hits = self.pool.num_free_blocks - sum(block.ref_cnt == 0 for block in hit_blocks)
        num_blocks_wanted = num_blocks_for(num_tokens, self.block_size) - len(hit_blocks)
        reserve = self.watermark_blocks if self.pool.num_held_blocks > 0 else 0
        if num_blocks_wanted + reserve > num_free_after_hits:
            return None
        num_cached_tokens = (len(hit_blocks) + len(tier_hashes)) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached_tokens
            self.tier_hits += len(tier_hashes) * self.block_size
        self.pool.touch(hit_blocks)
        # tier hits get fresh blocks, hashed below like computed ones: the worker loads them first
        table.blocks = hit_blocks + self.pool.allocate(len(tier_hashes))
        table.num_tokens, table.num_hashed_blocks = num_cached_tokens, len(hit_blocks)
        self._tables[request_id] = table
        if tier_hashes:
            self.tier.pin(request_id, tier_hashes)
            self._tier_loads[request_id] = list(enumerate(tier_hashes, len(hit_blocks)))
        # cannot fail: min(...) slots fit in the num_blocks_wanted blocks checked above
        self.allocate_slots(request_id, min(num_new_tokens, num_tokens - num_cached_tokens))
        return self.get_block_ids(request_id), num_cached_tokens

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> None:
        """Each child gets the parent's table (one more reference per block); the parent's is dropped."""
        parent = self._tables.get(parent_id)
        if parent is None:
            raise ValueError(f"fork of {parent_id!r}, which holds no table")
        if len(set(child_ids)) != len(child_ids) or any(c in self._tables or c == parent_id for c in child_ids):
            raise ValueError(f"fork of {parent_id!r}: child ids {list(child_ids)} repeat or already hold a table")
        for child_id in child_ids:
            self.pool.touch(parent.blocks)
            self._tables[child_id] = parent.fork()
        self.free(parent_id)

    def is_fresh_fork(self, request_id: str) -> bool:
        table = self._tables.get(request_id)
        return table is not None and table.is_fresh_fork

    def take_tier_loads(self, request_id: str) -> list[tuple[int, bytes]]:
        """(block index, hash) of the tier blocks the worker loads for a request admitted this step."""
        return self._tier_loads.pop(request_id, [])

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._block_copies = self._block_copies, []
        return copies

    def take_kv_events(self) -> tuple[bytes, bytes, bool]:
        """(stored, removed, cleared) since the last call; keys are KEY_BYTES-long hash prefixes."""
        stored, removed, cleared = self.pool.take_events()
        return b"".join(h[:KEY_BYTES] for h in stored), b"".join(h[:KEY_BYTES] for h in removed), cleared

    def reset_prefix_cache(self) -> int:
        """Empty the hash table; how many prefixes were dropped."""
        self.num_prefix_cache_resets += 1
        return self.pool.reset_cache()

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.release(reversed(table.blocks))
        if self.tier is not None:
            self._tier_loads.pop(request_id, None)
            self.tier.free(request_id)

    def preempt(self, request_id: str) -> None:
        """Free a running request; it will recompute from its prompt."""
        self.free(request_id)
        self.num_preemptions += 1

    def step(self, request: AllocRequest) -> AllocReply:
        return run_step(self, request)

    def _new_table(self, cache_salt: str = "") -> BlockTable:
        if not self.enable_prefix_caching:
            return BlockTable()
        return BlockTable(root=root_hash((*self.hash_keys, cache_salt)), tail_token_ids=[])

    def _must_copy_last_block(self, table: BlockTable) -> bool:
        """The next token goes into a partial last block that another table also lists."""
        return table.num_tokens % self.block_size != 0 and table.blocks[-1].ref_cnt > 1

    def _copy_last_block(self, table: BlockTable) -> None:
        shared = table.blocks[-1]
        (fresh,) = self.pool.allocate(1)
        self.pool.release([shared])  # still held by the other fork(s): never freed here
        table.blocks[-1] = fresh
        self._block_copies.append((shared.block_id, fresh.block_id))
        self.num_block_copies += 1

    def _cache_full_blocks(self, request_id: str, table: BlockTable) -> None:
        """Hash newly full blocks at allocation: the worker writes a layer's K/V before any
        attention reads it, so a later request in the same step may already hit them; the
        worker stores them in the tier once the step that computes them has run (a tier fill
        if its last token is not known here yet)."""
        num_hashable = min(table.num_tokens // self.block_size, len(table.block_hashes))
        for index in range(table.num_hashed_blocks, num_hashable):
            self.pool.cache(table.blocks[index], table.block_hashes[index])
            if self.tier is not None:
                self.tier.on_hashed(request_id, index, table.block_hashes[index])
        table.num_hashed_blocks = max(table.num_hashed_blocks, num_hashable)
        index = len(table.block_hashes)
        if self.tier is not None and table.tail_token_ids is not None and table.num_tokens >= (
                index + 1) * self.block_size:
            self.tier.on_filled(request_id, index, table.block_hashes[-1] if index else table.root)

    def stats(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_held_blocks": self.num_held_blocks,
            "usage": self.usage,
            "num_cached_blocks": self.pool.num_cached_blocks,
            "num_cached_free_blocks": self.pool.num_cached_free_blocks,
            "prefix_caching": self.enable_prefix_caching,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries
            else 0.0,
            "num_preemptions": self.num_preemptions,
            "num_evictions": self.pool.num_evictions,
            "num_block_copies": self.num_block_copies,
            "num_prefix_cache_resets": self.num_prefix_cache_resets,
            "prefix_cache_tier_hits": self.tier_hits,
        }

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        references: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            ids = table.block_ids
            assert len(set(ids)) == len(ids), f"request {request_id!r} lists a block twice: {ids}"
            assert len(ids) == num_blocks_for(table.num_tokens, self.block_size), (
                f"request {request_id!r} has {len(ids)} blocks for {table.num_tokens} tokens")
            assert table.num_hashed_blocks <= min(table.num_tokens // self.block_size, len(table.block_hashes)), (
                f"request {request_id!r} hashed {table.num_hashed_blocks} blocks beyond its full, known ones")
            for block, block_hash in zip(table.blocks[:table.num_hashed_blocks], table.block_hashes, strict=False):
                assert block.block_hash in (None, block_hash), (
                    f"request {request_id!r} lists block {block.block_id} under another prefix's hash")
            if table.num_tokens % self.block_size:
                last = table.blocks[-1]
                assert last.block_hash is None, f"partial block {last.block_id} of {request_id!r} is hashed"
                assert last.ref_cnt == 1 or table.is_fresh_fork, (
                    f"partial block {last.block_id} of {request_id!r} is shared outside a fresh fork")
            references.update(ids)
        for block in self.pool.blocks:
            assert block.ref_cnt == references[block.block_id], (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                f"{references[block.block_id]} block-table references")
