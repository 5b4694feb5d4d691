"""The api's only Redis code: submit and abort, this api's delta stream, heartbeat, the
scheduler-incarnation watch (resubmit on restart) and reading the stats blobs.

Every in-flight request has an asyncio.Queue that receives its RequestDeltas in order; the
request leaves the in-flight table when a delta finishes it or when it is aborted here.
Tokens delivered so far are kept per request, so when the scheduler's heartbeat value (its
incarnation) changes, every in-flight request is resubmitted with `output_token_ids` and
the new scheduler continues from there.

Admission: every admission.REFRESH_S the scheduler's stats blob is read into the
AdmissionGate, which Generation.start consults before submitting. Policy commands
(SetPolicy) go out on the requests stream; the scheduler's PolicyReply comes back on this
api's deltas stream and resolves the waiting command.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

import redis.asyncio as aioredis

from services.api.admission import REFRESH_S, AdmissionGate
from shared import redis_io
from shared.messages import (
    AbortRequest,
    DeltaBatch,
    PolicyReply,
    PrefixCacheReset,
    RequestDelta,
    SetPolicy,
    SubmitRequest,
)
from shared.redis_io import REDIS_ERRORS, Backoff, Heartbeat
from shared.streams import HEARTBEAT_INTERVAL_S, Keys

log = logging.getLogger("pagedserve.api.loop")

GROUP = "api"
MAX_REDIS_CONNECTIONS = 64  # for the submits of a burst, the readers and the heartbeat
_TRANSIENT = REDIS_ERRORS


class RedisUnavailable(RuntimeError):
    pass


@dataclass
class _InFlight:
    submit: SubmitRequest
    queue: asyncio.Queue
    output_token_ids: list[int] = field(default_factory=list)


class ApiLoop:
    def __init__(self, redis_url: str, keys: Keys, api_id: str | None = None, submit_timeout_s: float = 5.0,
                 admission: AdmissionGate | None = None):
        self.keys = keys
        self.admission = admission or AdmissionGate()
        self._commands: dict[str, asyncio.Future] = {}  # SetPolicy command_id -> its PolicyReply
        self.api_id = api_id or uuid.uuid4().hex[:12]
        self.submit_timeout_s = submit_timeout_s
        # a burst of submissions waits for a free connection (up to the submit timeout)
        # instead of failing with "Too many connections" and retrying
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=MAX_REDIS_CONNECTIONS,
                                                        timeout=submit_timeout_s, socket_timeout=10,
                                                        socket_connect_timeout=3, health_check_interval=30)
        self.redis = aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it
        self._in_flight: dict[str, _InFlight] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._scheduler_incarnation: str | None = None
        self._heartbeat = Heartbeat(self.redis, keys, f"api:{self.api_id}", self.api_id)

    @property
    def deltas_stream(self) -> str:
        return self.keys.api_deltas(self.api_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def start(self) -> None:
        """Start the background tasks; Redis being down is retried there, never fatal."""
        self._tasks.append(asyncio.create_task(self._run(), name="api-loop"))

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                await redis_io.ensure_group(self.redis, self.deltas_stream, GROUP)
                await self._heartbeat.start()
                break
            except _TRANSIENT as e:
                delay = backoff.next()
                log.warning("redis unavailable at start (%s); retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)
        log.info("api %s connected: deltas on %s", self.api_id, self.deltas_stream)
        await asyncio.gather(self._read_deltas(), self._watch_scheduler(), self._refresh_admission())

    async def stop(self) -> None:
        """Abort every in-flight request, stop the tasks, remove this api's keys."""
        for request_id in list(self._in_flight):
            self._end_locally(request_id, "abort")
            self.abort(request_id, reason="api shutdown")
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._heartbeat.stop()
            await self.redis.delete(self.deltas_stream)
        except _TRANSIENT:
            pass
        await self.redis.aclose()
        log.info("api %s stopped", self.api_id)

    # ---- requests --------------------------------------------------------------------

    async def submit(self, msg: SubmitRequest) -> asyncio.Queue:
        """Send a submission; its deltas arrive on the returned queue. RedisUnavailable if
        Redis cannot be reached within submit_timeout_s (nothing was submitted then)."""
        entry = _InFlight(msg, asyncio.Queue())
        self._in_flight[msg.request_id] = entry
        try:
            await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg),
                              f"submit {msg.request_id}", self.submit_timeout_s)
        except BaseException:
            self._in_flight.pop(msg.request_id, None)
            raise
        return entry.queue

    async def submit_group(self, msg: SubmitRequest, sequences: list[SubmitRequest]) -> list[asyncio.Queue]:
        """Send one submission with sampling.n > 1; the deltas of its n sequences (each
        described as its own n == 1 submission, which is what a restarted scheduler gets
        resubmitted) arrive on the returned queues. RedisUnavailable as submit()."""
        entries = [_InFlight(sequence, asyncio.Queue()) for sequence in sequences]
        for entry in entries:
            self._in_flight[entry.submit.request_id] = entry
        try:
            await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg),
                              f"submit {msg.request_id}", self.submit_timeout_s)
        except BaseException:
            for entry in entries:
                self._in_flight.pop(entry.submit.request_id, None)
            raise
        return [entry.queue for entry in entries]

    def abort(self, request_id: str, reason: str = "abort") -> asyncio.Task:
        """Stop listening to a request and tell the scheduler to abort it (sent in the
        background with retries, so a caller being cancelled cannot lose it)."""
        self._in_flight.pop(request_id, None)
        msg = AbortRequest(request_id, reason)
        task = asyncio.create_task(self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg),
                                               f"abort {request_id}", 60.0))
        self._background.add(task)
        task.add_done_callback(self._abort_done)
        return task

    def _abort_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("abort lost: %s", task.exception())

    def _end_locally(self, request_id: str, reason: str) -> None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            entry.queue.put_nowait(RequestDelta(request_id, [], finish_reason=reason))

    async def set_policy(self, name: str, options: dict, timeout_s: float = 10.0) -> PolicyReply:
        """Ask the scheduler to swap its policy; its reply, or TimeoutError / RedisUnavailable."""
        msg = SetPolicy(uuid.uuid4().hex, self.api_id, name, options)
        future = asyncio.get_running_loop().create_future()
        self._commands[msg.command_id] = future
        try:
            await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg), "set policy", 5.0)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._commands.pop(msg.command_id, None)

    async def reset_prefix_cache(self, timeout_s: float = 10.0, poll_s: float = 0.05) -> dict:
        """Ask for the prefix cache to be emptied (api -> scheduler -> kvstore); the
        kvstore's stats once they list this reset as done. TimeoutError or RedisUnavailable."""
        msg = PrefixCacheReset(uuid.uuid4().hex)
        await self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg), "reset prefix cache", 5.0)
        deadline = time.monotonic() + timeout_s
        while True:
            stats = (await self.read_stats())["kvstore"]
            if msg.reset_id in (stats.get("prefix_cache_reset_ids") or ()):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefix cache reset {msg.reset_id} not done in {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)

    # ---- stats and readiness ---------------------------------------------------------

    async def read_stats(self, names: tuple[str, ...] = ("scheduler", "kvstore")) -> dict[str, dict]:
        """{"scheduler": {...}, "kvstore": {...}} (or the blobs named); a blob missing or unreadable is {}."""
        out: dict[str, dict] = {}
        for name in names:
            try:
                value = await redis_io.read_stats(self.redis, self.keys, name)
            except _TRANSIENT as e:
                log.warning("stats unavailable: %s", e)
                value = None
            except Exception as e:  # not msgpack: a bug elsewhere, not a reason to fail a scrape
                log.warning("stats blob %s unreadable: %s", name, e)
                value = None
            out[name] = value if isinstance(value, dict) else {}
        return out

    async def missing_services(self) -> list[str]:
        """Which of scheduler, kvstore, a worker have no live heartbeat (Redis down: all)."""
        try:
            present = await self.redis.exists(self.keys.heartbeat("scheduler")), \
                await self.redis.exists(self.keys.heartbeat("kvstore"))
            workers = [k async for k in self.redis.scan_iter(match=self.keys.heartbeat_pattern("worker"), count=100)]
        except _TRANSIENT:
            return ["redis"]
        missing = [name for name, ok in zip(("scheduler", "kvstore"), present, strict=True) if not ok]
        return missing + ([] if workers else ["worker"])

    # ---- background tasks ------------------------------------------------------------

    async def _read_deltas(self) -> None:
        backoff = Backoff()
        while True:
            try:
                entries = await redis_io.read_group(self.redis, GROUP, self.api_id,
                                                    {self.deltas_stream: (DeltaBatch, PolicyReply)}, block_ms=1000,
                                                    count=64)
                backoff.reset()
            except _TRANSIENT as e:
                delay = backoff.next()
                log.warning("redis unavailable (reading deltas): %s; retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)
                continue
            for entry in entries:
                if entry.error is not None:
                    log.error("dropped a bad message %s on %s: %s", entry.entry_id, entry.stream, entry.error)
                elif isinstance(entry.message, PolicyReply):
                    future = self._commands.get(entry.message.command_id)
                    if future is not None and not future.done():
                        future.set_result(entry.message)
                else:
                    self._dispatch(entry.message)

    def _dispatch(self, batch: DeltaBatch) -> None:
        for delta in batch.deltas:
            entry = self._in_flight.get(delta.request_id)
            if entry is None:
                continue  # aborted or ended here already
            entry.output_token_ids.extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self._in_flight.pop(delta.request_id, None)
            entry.queue.put_nowait(delta)

    async def _refresh_admission(self) -> None:
        while True:
            try:
                blob = await redis_io.read_stats(self.redis, self.keys, "scheduler")
                if isinstance(blob, dict):
                    self.admission.update(blob)
            except _TRANSIENT as e:
                log.warning("admission table unavailable: %s", e)
            except Exception as e:  # not msgpack: a bug elsewhere; keep the last table
                log.warning("scheduler stats blob unreadable: %s", e)
            await asyncio.sleep(REFRESH_S)

    async def _watch_scheduler(self) -> None:
        while True:
            try:
                value = await redis_io.get_incarnation(self.redis, self.keys, "scheduler")
                if value is not None and value != self._scheduler_incarnation:
                    if self._scheduler_incarnation is not None:
                        await self._resubmit_all(self._scheduler_incarnation, value)
                    self._scheduler_incarnation = value
            except _TRANSIENT as e:
                log.warning("scheduler watch: %s", e)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _resubmit_all(self, old: str, new: str) -> None:
        entries = list(self._in_flight.values())
        log.warning("scheduler restarted (%s -> %s): resubmitting %d in-flight requests", old, new, len(entries))
        for entry in entries:
            msg = replace(entry.submit, output_token_ids=list(entry.output_token_ids))
            if entry.submit.request_id in self._in_flight:
                await self._retry(lambda m=msg: redis_io.send(self.redis, self.keys.requests, m),
                                  f"resubmit {msg.request_id}", 60.0)

    # ---- Redis plumbing --------------------------------------------------------------

    async def _retry(self, op, what: str, budget_s: float):
        delay, deadline = 0.05, time.monotonic() + budget_s
        while True:
            try:
                return await op()
            except _TRANSIENT as e:
                if time.monotonic() + delay > deadline:
                    raise RedisUnavailable(f"redis unavailable ({what}): {e}") from e
                log.warning("redis unavailable (%s): %s; retrying in %.2fs", what, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
