"""One BlockManager per live worker, keyed by worker id (pure; loop.py drives it over Redis).

A hello makes a new empty pool (replacing only that worker's); a pool answers empty until the
scheduler's reset arrives. COUNTERS never go down: replaced or dropped pools' counts carry over.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.kvstore.tier_index import TierIndex
from pagedserve.services.kvstore.tier_link import TierLink
from pagedserve.shared.messages import KEY_BYTES, AllocReply, AllocRequest, WorkerHello

log = logging.getLogger("pagedserve.kvstore")

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_evictions", "num_block_copies",
            "num_prefix_cache_resets", "prefix_cache_tier_hits")


@dataclass
class WorkerPool:
    hello: WorkerHello
    manager: BlockManager
    incarnation: str | None = None  # the heartbeat value the worker had when it joined
    synced: bool = False  # a reset has come since this pool was created
    last_step_id: int | None = None
    base: Counter[str] = field(default_factory=Counter)  # counters of this id's earlier pools


class WorkerPools:
    def __init__(self, enable_prefix_caching: bool = False, watermark: float = 0.01,
                 tier_capacity_bytes: int = 0) -> None:
        """tier_capacity_bytes: the offload tier every pool shares (0: none)."""
        self.enable_prefix_caching, self.watermark = enable_prefix_caching, watermark
        self.tier = TierIndex(tier_capacity_bytes) if tier_capacity_bytes > 0 and enable_prefix_caching else None
        self.pools: dict[str, WorkerPool] = {}
        self.dropped_base: Counter[str] = Counter()  # counters of every pool replaced or dropped

    def _manager(self, hello: WorkerHello) -> BlockManager:
        tier = None
        if self.tier is not None and hello.kv_tier_namespace and hello.kv_block_bytes > 0:
            tier = TierLink(self.tier, hello.kv_tier_namespace, hello.kv_block_bytes)
        return BlockManager(hello.num_blocks, hello.block_size, enable_prefix_caching=self.enable_prefix_caching,
                            watermark=self.watermark, hash_keys=(hello.model,), record_events=True, tier=tier)

    def join(self, hello: WorkerHello, incarnation: str | None = None) -> None:
        old = self.pools.get(hello.worker_id)
        base = Counter()
        if old is not None:
            _release_tier(old.manager)
            counts = _counters(old.manager)
            self.dropped_base.update(counts)
            base = old.base + counts
        self.pools[hello.worker_id] = WorkerPool(hello, self._manager(hello), incarnation, base=base)

    def drop(self, worker_id: str) -> int:
        """Forget the worker and its pool; the number of blocks its requests held."""
        pool = self.pools.pop(worker_id, None)
        if pool is None:
            return 0
        _release_tier(pool.manager)
        self.dropped_base.update(_counters(pool.manager))
        return pool.manager.num_held_blocks

    def apply(self, request: AllocRequest) -> AllocReply | None:
        """The reply to one worker's step, with its pool's KV events, or None for a redelivery."""
        pool = self.pools.get(request.worker_id)
        step_id = request.step_id
        if pool is None:
            log.error("alloc request for step %d of worker %r, which has not said hello", step_id, request.worker_id)
            return AllocReply(step_id, worker_id=request.worker_id)
        if not request.reset and pool.last_step_id is not None and step_id <= pool.last_step_id:
            log.warning("alloc request for step %d of worker %s redelivered (last %d): dropped", step_id,
                        request.worker_id, pool.last_step_id)
            return None
        if pool.manager.tier is not None:  # before a reset ends its reservations
            pool.manager.tier.confirm(request.tier_written)
            pool.manager.tier.confirm_filled(request.tier_filled)
        if not request.reset and not pool.synced:
            log.warning("alloc request for step %d of worker %s before the scheduler's reset: refused", step_id,
                        request.worker_id)
            return AllocReply(step_id, worker_id=request.worker_id)
        if request.reset:
            held = pool.manager.num_held_blocks
            self.join(pool.hello, pool.incarnation)
            pool = self.pools[request.worker_id]
            pool.synced = True
            log.info("worker %s reset by the scheduler at step %d (%d blocks were held)", request.worker_id,
                     step_id, held)
        pool.last_step_id = step_id
        manager = pool.manager
        try:
            reply = manager.step(request)
        except Exception as e:  # a request the manager refuses must not end the loop
            log.error("alloc request for step %d of worker %s refused: %s: %s", step_id, request.worker_id,
                      type(e).__name__, e)
            reply = AllocReply(step_id, num_free_blocks=manager.num_free_blocks, num_blocks=manager.num_blocks)
        reply.worker_id = request.worker_id
        reply.blocks_stored, reply.blocks_removed, cleared = manager.take_kv_events()
        # a reset pool is a new, empty one: whatever the scheduler indexed for it is gone
        reply.all_blocks_cleared = cleared or request.reset
        if self.tier is not None:  # the tier's events ride on whichever reply comes next
            stored, removed = self.tier.take_events()
            if request.reset:  # a (re)started scheduler knows nothing yet: the whole tier
                stored, removed, reply.tier_blocks_whole = [h for _ns, h in self.tier.keys()], [], True
            reply.tier_blocks_stored = b"".join(h[:KEY_BYTES] for h in stored)
            reply.tier_blocks_removed = b"".join(h[:KEY_BYTES] for h in removed)
        return reply

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, in the pools and in the tier."""
        num_tier = self.tier.clear() if self.tier is not None else 0
        return sum(pool.manager.reset_prefix_cache() for pool in self.pools.values()) + num_tier

    def take_tier_evicted(self) -> list[tuple[str, bytes]]:
        """(namespace, hash) of tier entries whose contents are to be deleted."""
        return self.tier.take_evicted() if self.tier is not None else []

    @property
    def num_held_blocks(self) -> int:
        return sum(pool.manager.num_held_blocks for pool in self.pools.values())

    def check_integrity(self) -> str | None:
        """The first broken invariant, naming its worker, or None."""
        for worker_id, pool in self.pools.items():
            try:
                pool.manager.check_integrity()
            except AssertionError as e:
                return f"worker {worker_id}: {e or 'integrity check failed'}"
        if self.tier is not None:
            try:
                self.tier.check_integrity()
                num_pins = sum(p.manager.tier.num_pins() for p in self.pools.values() if p.manager.tier)
                num_readers = sum(self.tier.readers(key) for key in self.tier.keys())
                assert num_pins == num_readers, f"tier: {num_readers} readers but the pools hold {num_pins} pins"
                reserved = {id(p.manager.tier): p.manager.tier.reserved() for p in self.pools.values()
                            if p.manager.tier is not None}
                for key, owner in self.tier.pending_owners().items():
                    assert key in reserved.get(id(owner), ()), f"tier: reservation {key[1].hex()[:8]} of no live pool"
            except AssertionError as e:
                return f"offload tier: {e or 'integrity check failed'}"
        return None

    def stats(self) -> dict:
        """Totals over every pool (counters monotonic), and "workers": each pool's own."""
        workers = {}
        for worker_id, pool in self.pools.items():
            own = pool.manager.stats()
            own.update({key: own[key] + pool.base[key] for key in COUNTERS})
            workers[worker_id] = own
        num_blocks = sum(own["num_blocks"] for own in workers.values())
        num_held = sum(own["num_held_blocks"] for own in workers.values())
        totals = {"num_blocks": num_blocks, "num_held_blocks": num_held,
                  "num_free_blocks": sum(own["num_free_blocks"] for own in workers.values()),
                  "usage": num_held / num_blocks if num_blocks else 0.0,
                  "num_cached_blocks": sum(own["num_cached_blocks"] for own in workers.values()),
                  "num_cached_free_blocks": sum(own["num_cached_free_blocks"] for own in workers.values()),
                  "prefix_caching": self.enable_prefix_caching}
        for key in COUNTERS:
            totals[key] = self.dropped_base[key] + sum(_counters(pool.manager)[key] for pool in self.pools.values())
        queries = totals["prefix_cache_queries"]
        totals["prefix_cache_hit_rate"] = totals["prefix_cache_hits"] / queries if queries else 0.0
        totals["workers"] = workers
        if self.tier is not None:
            totals.update(self.tier.stats())
        return totals


def _release_tier(manager: BlockManager) -> None:
    if manager.tier is not None:
        manager.tier.release_all()


def _counters(manager: BlockManager) -> Counter[str]:
    stats = manager.stats()
    return Counter({key: stats[key] for key in COUNTERS})
