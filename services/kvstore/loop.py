"""The kvstore service's Redis loop: the only kvstore file that touches Redis.

It owns one BlockManager, sized from the newest WorkerHello (a late joiner finds it with
XREVRANGE; every later hello replaces the manager: a new worker's pool is empty). Each
AllocRequest on kv_alloc (group "kvstore") is answered with exactly one AllocReply on
kv_reply; reset=True first replaces the manager by an empty one of the same size. A
request it cannot apply (does not decode, no worker yet, the manager refuses it) is
logged and answered with an empty AllocReply for its step_id: the scheduler then resets,
and this loop goes on. Until a reset arrives (after a start, or a new worker's hello) a
non-reset request is answered the same way: a fresh manager knows nothing of the running
requests it names, and a reply from it would hand out blocks that are in use. A non-reset
request whose step_id is not above the last one seen is a redelivery and is dropped.

Stats (keys.stats("kvstore")): BlockManager.stats() plus integrity_ok/integrity_error,
incarnation, step_id, worker_id; the counters (hits, evictions, copies, ...) run on across
manager replacements, so the api's Prometheus counters never go down; written at most every STATS_INTERVAL_S while busy and as
soon as the stream goes quiet; the full integrity check runs every INTEGRITY_INTERVAL_S while busy
and once quiet for QUIET_S. PAGEDSERVE_CHECK_INTEGRITY=1 checks after every step.
keys.stats("block_map"): block_map.block_map() of each worker's pool, at most once a second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import Counter

from services.kvstore.block_manager import BlockManager
from services.kvstore.block_map import BLOCK_MAP_INTERVAL_S, block_map
from shared import redis_io
from shared.messages import AllocReply, AllocRequest, PrefixCacheReset, WorkerHello
from shared.redis_io import Entry, Heartbeat
from shared.streams import Keys

log = logging.getLogger("pagedserve.kvstore")

GROUP = CONSUMER = "kvstore"
STATS_INTERVAL_S = 0.25  # at most 4 writes a second while busy: each is a Redis round trip
# a full check walks every block (4-5 ms for a 2 GiB pool, CPU taken from the worker's
# cores): every 10 s while busy, and once the stream has been quiet for QUIET_S with no block
# held by a request. Quiet is measured from the last change, not from one empty read (a read
# waits only until the next stats write is due, shorter than a decode step).
INTEGRITY_INTERVAL_S = 10.0
QUIET_S = 0.5
# counters of BlockManager.stats() carried over when the manager is replaced
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_evictions", "num_block_copies",
            "num_prefix_cache_resets")
NUM_RESET_IDS = 16


class KvStoreLoop:
    def __init__(self, r, keys: Keys, enable_prefix_caching: bool = False, watermark: float = 0.01,
                 check_every_step: bool | None = None) -> None:
        self.r, self.keys = r, keys
        self.enable_prefix_caching, self.watermark = enable_prefix_caching, watermark
        if check_every_step is None:
            check_every_step = os.environ.get("PAGEDSERVE_CHECK_INTEGRITY", "") not in ("", "0")
        self.check_every_step = check_every_step
        self.incarnation = uuid.uuid4().hex
        self.manager: BlockManager | None = None
        self.hello: WorkerHello | None = None
        self.hello_id = (0, 0)
        self.last_step_id: int | None = None
        self.synced = False  # a reset has come since the manager was created
        self.integrity_error: str | None = None
        self.last_integrity = 0.0
        self.last_change = 0.0  # monotonic time the manager last changed (0: never)
        self.last_stats = 0.0
        self.stats_dirty = True
        self.last_block_map = 0.0  # keys.stats("block_map"): the dashboard's per-block picture
        self.counter_base: Counter[str] = Counter()  # COUNTERS of the managers replaced so far
        self.reset_ids: list[str] = []  # PrefixCacheReset ids done, the newest last

    async def run(self, stop: asyncio.Event) -> int:
        await redis_io.ensure_group(self.r, self.keys.kv_alloc, GROUP, skip_backlog=True)
        await redis_io.ensure_group(self.r, self.keys.worker_hello, GROUP, skip_backlog=True)
        latest = await redis_io.latest_entry(self.r, self.keys.worker_hello, WorkerHello)
        if latest is not None:
            self._on_hello(*latest)
        heartbeat = Heartbeat(self.r, self.keys, "kvstore", self.incarnation)
        await heartbeat.start()
        log.info("kvstore ready: prefix=%s prefix_caching=%s incarnation=%s%s", self.keys.prefix,
                 self.enable_prefix_caching, self.incarnation, "" if self.manager else " (waiting for a worker)")
        streams = {self.keys.worker_hello: (WorkerHello,), self.keys.kv_alloc: (AllocRequest, PrefixCacheReset)}
        backoff = redis_io.Backoff()
        try:
            while not stop.is_set():
                try:
                    entries = await redis_io.read_group(self.r, GROUP, CONSUMER, streams, self._block_ms())
                    for entry in entries:
                        if entry.stream == self.keys.worker_hello:
                            if entry.error is None:
                                self._on_hello(entry.entry_id, entry.message)
                        elif isinstance(entry.message, PrefixCacheReset):
                            self._reset_prefix_cache(entry.message)
                        else:
                            await self._on_alloc(entry)
                    await self._write_stats(idle=not entries)
                    backoff.reset()
                except redis_io.REDIS_ERRORS as e:
                    delay = backoff.next()
                    log.error("redis error: %s; retrying in %.1fs", e, delay)
                    await asyncio.sleep(delay)
        finally:
            await heartbeat.stop()
        return 0

    def _on_hello(self, entry_id: bytes, hello: WorkerHello) -> None:
        if redis_io.stream_id_tuple(entry_id) <= self.hello_id:
            return
        self.hello_id = redis_io.stream_id_tuple(entry_id)
        self.hello = hello
        self.manager = self._new_manager()
        self.synced = False
        self.integrity_error, self.stats_dirty = None, True
        self.last_change = time.monotonic()
        log.info("worker %s joined: pool of %d blocks of %d tokens", hello.worker_id, hello.num_blocks,
                 hello.block_size)

    def _new_manager(self) -> BlockManager:
        if self.manager is not None:
            old = self.manager.stats()
            self.counter_base.update({key: old[key] for key in COUNTERS})
        return BlockManager(self.hello.num_blocks, self.hello.block_size,
                            enable_prefix_caching=self.enable_prefix_caching, watermark=self.watermark,
                            hash_keys=(self.hello.model,))

    def _reset_prefix_cache(self, command: PrefixCacheReset) -> None:
        num_dropped = self.manager.reset_prefix_cache() if self.manager is not None else 0
        log.info("prefix cache reset %s: %d cached prefixes dropped", command.reset_id, num_dropped)
        self.reset_ids = (self.reset_ids + [command.reset_id])[-NUM_RESET_IDS:]
        self.stats_dirty, self.last_change = True, time.monotonic()

    async def _on_alloc(self, entry: Entry) -> None:
        request: AllocRequest | None = entry.message
        step_id = request.step_id if request is not None else redis_io.peek_step_id(entry.raw)
        if request is None:
            log.error("bad alloc request %s (step %s): %s", entry.entry_id, step_id, entry.error)
            reply = AllocReply(step_id) if step_id is not None else None
        elif self.manager is None:
            log.error("alloc request for step %d before any worker said hello", step_id)
            reply = AllocReply(step_id)
        elif not request.reset and self.last_step_id is not None and step_id <= self.last_step_id:
            log.warning("alloc request for step %d redelivered (last %d): dropped", step_id, self.last_step_id)
            reply = None
        elif not request.reset and not self.synced:
            log.warning("alloc request for step %d before the scheduler's reset: refused", step_id)
            reply = AllocReply(step_id)
        else:
            reply = self._apply(request)
        if reply is not None:
            await redis_io.send(self.r, self.keys.kv_reply, reply)
            self.stats_dirty, self.last_change = True, time.monotonic()

    def _apply(self, request: AllocRequest) -> AllocReply:
        if request.reset:
            held = self.manager.num_held_blocks
            self.manager, self.synced = self._new_manager(), True
            log.info("reset by the scheduler at step %d (%d blocks were held)", request.step_id, held)
        self.last_step_id = request.step_id
        try:
            reply = self.manager.step(request)
        except Exception as e:  # a request the manager refuses must not end the loop
            log.error("alloc request for step %d refused: %s: %s", request.step_id, type(e).__name__, e)
            reply = AllocReply(request.step_id, num_free_blocks=self.manager.num_free_blocks,
                               num_blocks=self.manager.num_blocks)
        if self.check_every_step:
            self._check_integrity()
            if self.integrity_error is not None:
                log.error("integrity check failed after step %d: %s", request.step_id, self.integrity_error)
        return reply

    def _check_integrity(self) -> None:
        self.last_integrity = time.monotonic()
        if self.manager is None:
            self.integrity_error = None
            return
        try:
            self.manager.check_integrity()
            self.integrity_error = None
        except AssertionError as e:
            self.integrity_error = str(e) or "integrity check failed"

    def _integrity_due(self, now: float, idle: bool) -> bool:
        if self.check_every_step or self.last_change <= self.last_integrity:
            return False  # checked after every step, or nothing changed since the last check
        return now - self.last_integrity >= INTEGRITY_INTERVAL_S or (idle and self._settled(now))

    def _settled(self, now: float) -> bool:
        """Quiet for QUIET_S and no block held by a request: the burst is over. While requests
        hold blocks another step is coming, however long the last one took (a float32 step of
        128 requests takes 0.6 s on a 2-core Zen 3: "quiet for 0.5 s" alone checked every step)."""
        return now - self.last_change >= QUIET_S and (self.manager is None or self.manager.num_held_blocks == 0)

    def _block_ms(self) -> int:
        """How long a read may wait: until the next stats write or integrity check falls due
        (a read that times out is "idle"), else 1 s. Not a fixed short poll: while busy,
        steps come every few tens of ms and each wake-up takes CPU from the worker's cores."""
        now = time.monotonic()
        deadlines = [now + 1.0]
        if self.stats_dirty:
            deadlines.append(self.last_stats + STATS_INTERVAL_S)
        if not self.check_every_step and self.last_change > self.last_integrity:
            deadlines.append(self.last_integrity + INTEGRITY_INTERVAL_S)
            if self.manager is None or self.manager.num_held_blocks == 0:
                deadlines.append(self.last_change + QUIET_S)
        return max(1, round((min(deadlines) - now) * 1000))

    async def _write_stats(self, idle: bool) -> None:
        now = time.monotonic()
        if self._integrity_due(now, idle):
            self._check_integrity()
            self.stats_dirty = True
        if not self.stats_dirty or (not idle and now - self.last_stats < STATS_INTERVAL_S):
            return
        stats = self.manager.stats() if self.manager is not None else {"num_blocks": 0, "num_held_blocks": 0,
                                                                       "num_free_blocks": 0, "usage": 0.0}
        for key in COUNTERS:
            stats[key] = stats.get(key, 0) + self.counter_base[key]
        stats.update(integrity_ok=self.integrity_error is None, integrity_error=self.integrity_error,
                     prefix_cache_reset_ids=self.reset_ids,
                     incarnation=self.incarnation, step_id=self.last_step_id,
                     worker_id=self.hello.worker_id if self.hello is not None else None)
        await redis_io.write_stats(self.r, self.keys, "kvstore", stats)
        map_due = now - self.last_block_map >= BLOCK_MAP_INTERVAL_S
        if map_due:
            workers = {self.hello.worker_id: self.manager} if self.hello is not None else {}
            await redis_io.write_stats(self.r, self.keys, "block_map", block_map(workers))
            self.last_block_map = now
        self.last_stats, self.stats_dirty = now, not idle or not map_due  # a map not due yet: come back
