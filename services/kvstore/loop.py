"""The kvstore's Redis loop: one pool per worker whose heartbeat (lease) lives; every AllocRequest
gets exactly one AllocReply (empty if it does not decode, so the scheduler resets that worker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid

import msgpack

from pagedserve.services.kvstore.block_map import BLOCK_MAP_INTERVAL_S, block_map
from pagedserve.services.kvstore.tier_sweep import TierSweep
from pagedserve.services.kvstore.worker_pools import WorkerPools
from pagedserve.shared import redis_io
from pagedserve.shared.kv_tier import lru_member, parse_tier_key, tier_key, tier_lru_key, tier_pattern
from pagedserve.shared.messages import AllocReply, AllocRequest, CommandReply, PrefixCacheReset, WorkerHello
from pagedserve.shared.redis_io import Entry, Heartbeat
from pagedserve.shared.streams import HEARTBEAT_TTL_S, Keys

log = logging.getLogger("pagedserve.kvstore")

GROUP = CONSUMER = "kvstore"
STATS_INTERVAL_S = 0.25  # each write is a Redis round trip
# a full check walks every block: run it every 10 s while busy, and once quiet (from the last change) for QUIET_S
INTEGRITY_INTERVAL_S = 10.0
WALK_SHARE = 0.01  # a walk over every block (integrity, block map) waits until it costs at most 1% of the time
QUIET_S = 0.5
LEASE_CHECK_S = 1.0
HELLO_SCAN = 1000  # hellos read back at start (the worker keeps the stream this long)


class KvStoreLoop:
    def __init__(self, r, keys: Keys, enable_prefix_caching: bool = False, watermark: float = 0.01,
                 check_every_step: bool | None = None, tier_capacity_bytes: int = 0) -> None:
        self.r, self.keys = r, keys
        if check_every_step is None:
            check_every_step = os.environ.get("PAGEDSERVE_CHECK_INTEGRITY", "") not in ("", "0")
        self.check_every_step = check_every_step
        self.incarnation = uuid.uuid4().hex
        self.pools = WorkerPools(enable_prefix_caching, watermark, tier_capacity_bytes)
        self.hello_ids: dict[str, tuple[int, int]] = {}  # worker id -> newest hello entry id
        self.last_step_id: int | None = None
        self.integrity_error: str | None = None
        self.last_integrity = 0.0
        self.last_change = 0.0  # monotonic time a pool last changed (0: never)
        self.last_stats = 0.0
        self.next_lease_check = 0.0
        self.redis_trouble_at = float("-inf")  # the last Redis error (leases are judged after a grace)
        self.stats_dirty = True
        self.last_block_map = 0.0
        # busy-time walks: their base interval, stretched to cost / WALK_SHARE (a pool of many blocks)
        self.integrity_interval_s = INTEGRITY_INTERVAL_S
        self.block_map_interval_s = BLOCK_MAP_INTERVAL_S
        self.tier_lru_seq = 0  # the score of the tier's most recent use recorded in redis
        self.sweep = TierSweep()
        self.replies: list[tuple[str, AllocReply]] = []  # sent with the next read, in its round trip

    async def run(self, stop: asyncio.Event) -> int:
        await redis_io.ensure_group(self.r, self.keys.kv_alloc, GROUP, skip_backlog=True)
        await redis_io.ensure_group(self.r, self.keys.worker_hello, GROUP, skip_backlog=True)
        await self._bootstrap_workers()
        await self._bootstrap_tier()
        heartbeat = Heartbeat(self.r, self.keys, "kvstore", self.incarnation)
        await heartbeat.start()
        log.info("kvstore ready: prefix=%s prefix_caching=%s incarnation=%s workers=%s", self.keys.prefix,
                 self.pools.enable_prefix_caching, self.incarnation, sorted(self.pools.pools) or "none yet")
        streams = {self.keys.worker_hello: (WorkerHello,), self.keys.kv_alloc: (AllocRequest, PrefixCacheReset)}
        backoff = redis_io.Backoff()
        try:
            while not stop.is_set():
                try:
                    replies, self.replies = self.replies, []
                    try:
                        entries, failure = await redis_io.read_group(self.r, GROUP, CONSUMER, streams,
                                                                     self._block_ms(), sends=replies), None
                    except redis_io.SendFailed as e:  # what the read took (acked) is handled, then the failure
                        entries, failure = e.entries, e
                    for entry in entries:
                        if entry.stream == self.keys.worker_hello:
                            if entry.error is None:
                                await self._on_hello(entry.entry_id, entry.message)
                        elif isinstance(entry.message, PrefixCacheReset):
                            await self._reset_prefix_cache(entry.message)
                        else:
                            await self._on_alloc(entry)
                    if failure is not None:
                        raise failure
                    if self.replies and self._round_trip_due():
                        await self._send_replies()
                    if time.monotonic() >= self.next_lease_check:
                        await self._check_leases()
                    await self._write_stats(idle=not entries)
                    await self._sweep_tier()
                    backoff.reset()
                except redis_io.REDIS_ERRORS as e:
                    delay = backoff.next()
                    self.redis_trouble_at = time.monotonic()
                    log.error("redis error: %s; retrying in %.1fs", e, delay)
                    await asyncio.sleep(delay)
        finally:
            with contextlib.suppress(*redis_io.REDIS_ERRORS):
                await self._send_replies()
            await heartbeat.stop()
        return 0

    def _round_trip_due(self) -> bool:
        """A lease check, stats write or sweep is due: it would hold the replies back a round trip."""
        return self._block_ms() <= 1 or (self.pools.tier is not None and self.sweep.due(time.monotonic()))

    async def _send_replies(self) -> None:
        replies, self.replies = self.replies, []
        await redis_io.send_all(self.r, replies)

    async def _bootstrap_workers(self) -> None:
        for entry_id, hello in await redis_io.newest_per_worker(self.r, self.keys.worker_hello, WorkerHello,
                                                                 HELLO_SCAN):
            if await redis_io.get_incarnation(self.r, self.keys, f"worker:{hello.worker_id}") is not None:
                await self._on_hello(entry_id, hello)

    async def _bootstrap_tier(self) -> None:
        """The tier's contents outlive this process in Redis: index what is there (sizes as stored),
        in the LRU order last recorded (blocks it lacks first, in scan order), deleting what no
        longer fits; then record that order afresh."""
        tier = self.pools.tier
        if tier is None:
            return
        keys = [key async for key in self.r.scan_iter(match=tier_pattern(self.keys), count=1000)]
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        pipe.zrange(tier_lru_key(self.keys), 0, -1, withscores=True)
        *sizes, ranked = await pipe.execute()
        rank = {_text(member): score for member, score in ranked}
        found = []
        for key, size in zip(keys, sizes, strict=True):
            parsed = parse_tier_key(self.keys, _text(key))
            if parsed is not None and size > 0:
                found.append((rank.get(lru_member(*parsed), float("-inf")), parsed, size))
        found.sort(key=lambda item: item[0])  # stable: unranked blocks keep scan order
        for _score, parsed, size in found:
            tier.insert(parsed, size)
        tier.take_touched()
        order = [lru_member(*key) for key in tier.keys()]
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(tier_lru_key(self.keys))
        if order:
            pipe.zadd(tier_lru_key(self.keys), {member: n for n, member in enumerate(order, 1)})
        await pipe.execute()
        self.tier_lru_seq = len(order)
        await self._sync_tier()
        if keys:
            log.info("offload tier: %d blocks (%d bytes) found in redis, %d in a known LRU order", len(tier),
                     tier.used_bytes, sum(score > float("-inf") for score, _p, _s in found))

    async def _sync_tier(self) -> None:
        """Delete evicted blocks' contents and record the LRU order's changes, in one round trip."""
        evicted = self.pools.take_tier_evicted()
        touched = self.pools.tier.take_touched() if self.pools.tier is not None else []
        if not evicted and not touched:
            return
        pipe = self.r.pipeline(transaction=False)
        if evicted:
            pipe.delete(*(tier_key(self.keys, namespace, h) for namespace, h in evicted))
            pipe.zrem(tier_lru_key(self.keys), *(lru_member(namespace, h) for namespace, h in evicted))
        if touched:
            scores = {lru_member(*key): self.tier_lru_seq + n for n, key in enumerate(touched, 1)}
            self.tier_lru_seq += len(touched)
            pipe.zadd(tier_lru_key(self.keys), scores)
        await pipe.execute()

    async def _sweep_tier(self) -> None:
        """A bounded pass over orphaned tier writes; nothing else changes the index until it is done."""
        tier, now = self.pools.tier, time.monotonic()
        if tier is None or not self.sweep.due(now):
            return
        cursor, found = await self.r.scan(self.sweep.cursor, match=tier_pattern(self.keys), count=self.sweep.count)
        orphans = self.sweep.orphans(tier, [(_text(key), parse_tier_key(self.keys, _text(key))) for key in found])
        if orphans:
            await self.r.delete(*orphans)
            self.stats_dirty = True
            log.info("offload tier: deleted %d orphaned block writes", len(orphans))
        self.sweep.advance(int(cursor), now, len(orphans))

    async def _on_hello(self, entry_id: bytes, hello: WorkerHello) -> None:
        new, incarnation = await redis_io.accept_hello(self.r, self.keys, self.hello_ids, entry_id, hello.worker_id)
        if not new:
            return
        self.pools.join(hello, incarnation)
        self.integrity_error, self.stats_dirty = None, True
        self.last_change = time.monotonic()
        log.info("worker %s joined: pool of %d blocks of %d tokens (%d workers)", hello.worker_id,
                 hello.num_blocks, hello.block_size, len(self.pools.pools))

    async def _check_leases(self) -> None:
        self.next_lease_check = time.monotonic() + LEASE_CHECK_S
        worker_ids = list(self.pools.pools)
        if not worker_ids:
            return
        values = await self.r.mget([self.keys.heartbeat(f"worker:{w}") for w in worker_ids])
        # a lease a restarted Redis lost comes back with the worker's next beat: silence is not death
        grace = time.monotonic() - self.redis_trouble_at < HEARTBEAT_TTL_S
        for worker_id, value in zip(worker_ids, values, strict=True):
            pool = self.pools.pools.get(worker_id)
            if pool is None or (value is None and grace) or (value is not None and pool.incarnation in (
                    None, value.decode())):
                continue
            held = self.pools.drop(worker_id)
            log.warning("worker %s %s: its pool is dropped (%d blocks were held)", worker_id,
                        "lease expired" if value is None else "restarted", held)
            self.stats_dirty, self.last_change = True, time.monotonic()

    async def _reset_prefix_cache(self, command: PrefixCacheReset) -> None:
        """Reset, then stats that show it, then the api's reply: what it reads after the reply is current."""
        num_dropped = self.pools.reset_prefix_cache()
        log.info("prefix cache reset %s: %d cached prefixes dropped", command.command_id, num_dropped)
        await self._sync_tier()
        self.stats_dirty, self.last_change = True, time.monotonic()
        await self._write_stats(idle=True)
        stats = self.pools.stats()
        result = {key: stats[key] for key in ("num_cached_blocks", "num_prefix_cache_resets")}
        await redis_io.send(self.r, self.keys.api_deltas(command.api_id), CommandReply(command.command_id, True, result))

    async def _on_alloc(self, entry: Entry) -> None:
        request: AllocRequest | None = entry.message
        if request is None:
            step_id = redis_io.peek_step_id(entry.raw)
            log.error("bad alloc request %s (step %s): %s", entry.entry_id, step_id, entry.error)
            reply = AllocReply(step_id, worker_id=_peek_worker_id(entry.raw)) if step_id is not None else None
        else:
            reply = self.pools.apply(request)
            if reply is not None:
                self.last_step_id = request.step_id
                if self.check_every_step:
                    self._check_integrity()
                    if self.integrity_error is not None:
                        log.error("integrity check failed after step %d: %s", request.step_id, self.integrity_error)
        if reply is not None:
            await self._sync_tier()  # evicted contents deleted before any worker could store a block anew under one
            self.replies.append((self.keys.kv_reply, reply))
            self.stats_dirty, self.last_change = True, time.monotonic()

    def _check_integrity(self) -> None:
        started = time.monotonic()
        self.integrity_error = self.pools.check_integrity()
        self.last_integrity = time.monotonic()
        self.integrity_interval_s = max(INTEGRITY_INTERVAL_S, (self.last_integrity - started) / WALK_SHARE)

    def _integrity_due(self, now: float, idle: bool) -> bool:
        if self.check_every_step or self.last_change <= self.last_integrity:
            return False  # checked after every step, or nothing changed since the last check
        return now - self.last_integrity >= self.integrity_interval_s or (idle and self._settled(now))

    def _settled(self, now: float) -> bool:
        """Quiet for QUIET_S and no block held: while requests hold blocks another step is coming."""
        return now - self.last_change >= QUIET_S and self.pools.num_held_blocks == 0

    def _block_ms(self) -> int:
        """Wait until the next stats write, integrity or lease check is due; polling would take workers' CPU."""
        now = time.monotonic()
        deadlines = [now + 1.0]
        if self.pools.pools:
            deadlines.append(self.next_lease_check)
        if self.stats_dirty:
            deadlines.append(self.last_stats + STATS_INTERVAL_S)
        if not self.check_every_step and self.last_change > self.last_integrity:
            deadlines.append(self.last_integrity + self.integrity_interval_s)
            if self.pools.num_held_blocks == 0:
                deadlines.append(self.last_change + QUIET_S)
        return max(1, round((min(deadlines) - now) * 1000))

    async def _write_stats(self, idle: bool) -> None:
        now = time.monotonic()
        if self._integrity_due(now, idle):
            self._check_integrity()
            self.stats_dirty = True
        if not self.stats_dirty or (not idle and now - self.last_stats < STATS_INTERVAL_S):
            return
        stats = self.pools.stats()
        if self.pools.tier is not None:
            stats["tier_num_swept"] = self.sweep.num_swept
        stats.update(integrity_ok=self.integrity_error is None, integrity_error=self.integrity_error,
                     incarnation=self.incarnation,
                     step_id=self.last_step_id, worker_ids=sorted(self.pools.pools))
        await redis_io.write_stats(self.r, self.keys, "kvstore", stats)
        map_due = now - self.last_block_map >= self.block_map_interval_s
        if map_due:
            managers = {worker_id: pool.manager for worker_id, pool in self.pools.pools.items()}
            blob = block_map(managers)
            self.block_map_interval_s = max(BLOCK_MAP_INTERVAL_S, (time.monotonic() - now) / WALK_SHARE)
            await redis_io.write_stats(self.r, self.keys, "block_map", blob)
            self.last_block_map = now
        self.last_stats, self.stats_dirty = now, not idle or not map_due  # a map not due yet: come back


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _peek_worker_id(raw: bytes | None) -> str:
    try:
        worker_id = msgpack.unpackb(raw, raw=False)["d"]["worker_id"]
    except Exception:  # garbage of any shape
        return ""
    return worker_id if isinstance(worker_id, str) else ""
