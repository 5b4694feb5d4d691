"""The api's Redis loop: submit and abort, its delta stream, request records, restart watches;
what is live here, and what a delta does to it, is the live table's (live_table.py).

Each DeltaBatch's events are appended to the records and the batch acked in one pipeline;
deltas carry offsets, so a batch re-read after a crash is never applied twice. A new
scheduler or a restarted Redis gets every live sequence resubmitted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from pagedserve.services.api.admission import REFRESH_S, AdmissionGate
from pagedserve.services.api.control import ControlCommands
from pagedserve.services.api.generation import Generation, Output
from pagedserve.services.api.live_table import LiveTable, record_id_of
from pagedserve.services.api.records import RecordStore, refusals
from pagedserve.services.api.request import ApiRequest
from pagedserve.shared import redis_fast, redis_io
from pagedserve.shared.codec import pack
from pagedserve.shared.messages import (
    AbortRequest,
    CommandReply,
    DeltaBatch,
)
from pagedserve.shared.parallel_sampling import child_request_ids
from pagedserve.shared.redis_connect import async_client
from pagedserve.shared.redis_io import DEFAULT_MAXLEN, REDIS_ERRORS, Backoff, Heartbeat, RunIdWatch
from pagedserve.shared.streams import FIELD, HEARTBEAT_INTERVAL_S, Keys

log = logging.getLogger("pagedserve.api.loop")

GROUP = "api"
MAX_REDIS_CONNECTIONS = 64  # for the submits of a burst, the readers and the heartbeat
STOP_STEP_TIMEOUT_S = 3.0  # each step of stop(); uvicorn's graceful shutdown is 5 s, a supervisor's grace 20 s
_TRANSIENT = REDIS_ERRORS


class RedisUnavailable(RuntimeError):
    pass


class ApiLoop(ControlCommands):
    def __init__(self, redis_url: str, keys: Keys, api_id: str | None = None, submit_timeout_s: float = 5.0,
                 admission: AdmissionGate | None = None, record_ttl_s: int = 3600):
        self.keys = keys
        self.admission = admission or AdmissionGate()
        self._commands: dict[str, asyncio.Future] = {}  # admin command_id -> its CommandReply
        self.api_id = api_id or uuid.uuid4().hex[:12]
        self.submit_timeout_s = submit_timeout_s
        # a burst of submits waits for a free connection instead of failing
        self.redis = async_client(redis_url, blocking=True, max_connections=MAX_REDIS_CONNECTIONS,
                                  timeout=submit_timeout_s, socket_timeout=10, socket_connect_timeout=3,
                                  health_check_interval=30)  # owns its pool: aclose() closes it
        self.records = RecordStore(self.redis, keys, record_ttl_s)
        self.adopt: Callable[[str, dict, object], ApiRequest] | None = None  # set by the app
        self.table = LiveTable()
        self._write_lock = asyncio.Lock()  # record events are appended in seq order
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._scheduler_incarnation: str | None = None
        self._redis_watch = RunIdWatch()
        self._heartbeat = Heartbeat(self.redis, keys, f"api:{self.api_id}", self.api_id)

    @property
    def deltas_stream(self) -> str:
        return self.keys.api_deltas(self.api_id)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run(), name="api-loop"))

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                await redis_io.ensure_group(self.redis, self.deltas_stream, GROUP)
                await self._heartbeat.start()
                await self._redis_watch.changed(self.redis)
                break
            except _TRANSIENT as e:
                delay = backoff.next()
                log.warning("redis unavailable at start (%s); retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)
        log.info("api %s connected: deltas on %s", self.api_id, self.deltas_stream)
        await asyncio.gather(self._read_deltas(), self._watch_restarts(), self._refresh_admission())

    async def stop(self) -> None:
        """Stop the tasks, aborting nothing: this api id, restarted, reads the deltas that came meanwhile."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        for task in self._tasks:
            task.cancel()
        # every step bounded: a stop that waits on Redis must not outlast the supervisor's grace
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_STEP_TIMEOUT_S)
        for step in (self._heartbeat.stop(), self.redis.aclose()):
            try:
                await asyncio.wait_for(step, STOP_STEP_TIMEOUT_S)
            except (TimeoutError, *_TRANSIENT) as e:
                log.warning("api %s stop: %s", self.api_id, type(e).__name__)
        log.info("api %s stopped", self.api_id)

    async def submit(self, request: ApiRequest) -> None:
        """Record and submit in one pipeline; RedisUnavailable (nothing submitted) after submit_timeout_s."""
        group = request.group_submit()
        self.table.add(request)

        async def op():
            pipe = self.redis.pipeline(transaction=False)
            self.records.create(pipe, request.request_id, request.meta(self.api_id), group)
            pipe.xadd(self.keys.requests, {FIELD: pack(group)}, maxlen=DEFAULT_MAXLEN, approximate=True)
            await pipe.execute()

        try:
            await self._retry(op, f"submit {request.request_id}", self.submit_timeout_s)
        except BaseException:
            self.table.discard(request)
            raise

    def abort(self, request_id: str, reason: str = "abort") -> asyncio.Task:
        """Abort a sequence, sent in the background so a cancelled caller cannot lose it."""
        msg = AbortRequest(request_id, reason)
        return self._in_background(self._retry(lambda: redis_io.send(self.redis, self.keys.requests, msg),
                                               f"abort {request_id}", 60.0))

    def end(self, gen: Generation, reason: str, why: str) -> None:
        """End a live sequence: abort it at the scheduler, record the finish, wake its listener."""
        self.abort(gen.sequence_id, why)
        gen.finish(reason, why)
        out = Output("", [], finish_reason=reason)
        submitted = self.table.request(gen.request.request_id) is not None
        self.table.retire(gen)
        if gen.outputs is not None:
            gen.outputs.put_nowait(out)
        if submitted:
            self._in_background(self._write([(gen, out)]))

    async def cancel(self, request_id: str, reason: str) -> bool:
        """DELETE from any replica: abort every sequence of a request; False: no such record."""
        request = self.table.request(request_id)
        if request is not None:
            request.close(reason)
            return True
        loaded = await self.records.load(request_id)
        if loaded is None:
            return False
        for sequence_id in child_request_ids(request_id, loaded[0]["n"]):
            self.abort(sequence_id, reason)
        return True

    def _in_background(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background write lost: %s", task.exception())

    async def read_stats(self, names: tuple[str, ...] = ("scheduler", "kvstore")) -> dict[str, dict]:
        """{name: blob} for the names given; a blob missing or unreadable is {}."""
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
            worker = await anext(self.redis.scan_iter(match=self.keys.heartbeat_pattern("worker"), count=100), None)
        except _TRANSIENT:
            return ["redis"]
        missing = [name for name, ok in zip(("scheduler", "kvstore"), present, strict=True) if not ok]
        return missing + ([] if worker is not None else ["worker"])

    async def _read_deltas(self) -> None:
        backoff, pending = Backoff(), True  # first what an earlier run read and did not acknowledge
        while True:
            try:
                entries = await redis_io.read_group(self.redis, GROUP, self.api_id,
                                                    {self.deltas_stream: (DeltaBatch, CommandReply)}, block_ms=1000,
                                                    count=64, noack=False, pending=pending)
                backoff.reset()
            except _TRANSIENT as e:
                delay = backoff.next()
                log.warning("redis unavailable (reading deltas): %s; retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)
                continue
            pending = pending and bool(entries)
            items: list[tuple[Generation, Output]] = []
            failed = False
            try:
                for entry in entries:
                    if entry.error is not None:
                        log.error("dropped a bad message %s on %s: %s", entry.entry_id, entry.stream, entry.error)
                    elif isinstance(entry.message, CommandReply):
                        future = self._commands.get(entry.message.command_id)
                        if future is not None and not future.done():
                            future.set_result(entry.message)
                    else:
                        await self._apply(entry.message, items)
            except _TRANSIENT as e:  # adopting a request needs its record: read the batch again
                log.warning("redis unavailable (adopting a request): %s", e)
                failed = pending = True
            if entries:  # what was applied is written even so: a re-read batch trims repeats
                await self._write(items, [] if failed else [entry.entry_id for entry in entries])
            for gen, out in items:
                if gen.outputs is not None:
                    gen.outputs.put_nowait(out)
            if failed:
                await asyncio.sleep(backoff.next())

    async def _apply(self, batch: DeltaBatch, items: list[tuple[Generation, Output]]) -> None:
        for sequence_id in self.table.unknown(batch):
            if not self.table.knows(sequence_id):  # else adopted with a sequence before it
                await self._adopt(sequence_id)
        outputs, aborts = self.table.apply(batch)
        items.extend(outputs)
        for sequence_id, why in aborts:
            self.abort(sequence_id, why)

    async def _write(self, items: list[tuple[Generation, Output]], ack: list[bytes] = ()) -> None:
        """Append the events and ack the entries in one pipeline, retried until Redis takes it."""
        backoff = Backoff(cap=1.0)
        async with self._write_lock:
            for gen, out in items:
                gen.request.seq += 1
                out.seq = gen.request.seq
            events = [(gen.request.request_id, out.seq, gen.event(out), out.finish_reason is not None)
                      for gen, out in items]
            commands = ([self.records.append_command(events)] if events else []) + \
                ([("XACK", self.deltas_stream, GROUP, *ack)] if ack else [])
            while commands:
                try:
                    replies = await redis_fast.execute(self.redis, commands)
                    for error in refusals(replies):
                        log.error("a record write was refused: %s", error)  # a bug here, not Redis
                    return
                except _TRANSIENT as e:
                    delay = backoff.next()
                    log.warning("redis unavailable (writing records): %s; retrying in %.1fs", e, delay)
                    await asyncio.sleep(delay)

    async def _adopt(self, sequence_id: str) -> None:
        """A sequence submitted before a restart: its request rebuilt and replayed from its record."""
        record_id = record_id_of(sequence_id)
        loaded = await self.records.load(record_id) if self.adopt is not None else None
        if loaded is None:
            self.table.forget(sequence_id)
            log.warning("deltas for %s, which has no record: dropped", sequence_id)
            return
        request = self.adopt(record_id, *loaded)
        self.table.adopt(request, await self.records.events(record_id))
        if self.table.request(record_id) is not None:
            log.info("adopted request %s from its record (%d events)", record_id, request.seq)

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

    async def _watch_restarts(self) -> None:
        """A new scheduler or a restarted Redis: submit every live sequence again."""
        while True:
            try:
                if await self._redis_watch.changed(self.redis):
                    await self._retry(self._rewrite_records, "records after a Redis restart", 60.0)
                    await self._resubmit_all("redis restarted")
                value = await redis_io.get_incarnation(self.redis, self.keys, "scheduler")
                if value is not None and value != self._scheduler_incarnation:
                    if self._scheduler_incarnation is not None:
                        await self._resubmit_all(f"scheduler restarted ({self._scheduler_incarnation} -> {value})")
                    self._scheduler_incarnation = value
            except _TRANSIENT as e:
                log.warning("restart watch: %s", e)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _rewrite_records(self) -> None:
        await redis_io.ensure_group(self.redis, self.deltas_stream, GROUP)
        async with self._write_lock:
            pipe, events = self.redis.pipeline(transaction=False), []
            for request in self.table.requests():
                self.records.create(pipe, request.request_id, request.meta(self.api_id), request.group_submit())
                for gen in request.gens:
                    request.seq += 1
                    events.append((request.request_id, request.seq, gen.snapshot_event(), gen.finished))
            self.records.append(pipe, events, expire=True)
            await pipe.execute()
        log.warning("redis restarted: %d request records written again", len(self.table.requests()))

    async def _resubmit_all(self, why: str) -> None:
        gens = self.table.sequences()
        log.warning("%s: resubmitting %d live sequences", why, len(gens))
        for gen in gens:
            msg = gen.submit_message()
            if self.table.is_live(gen.sequence_id):
                await self._retry(lambda m=msg: redis_io.send(self.redis, self.keys.requests, m),
                                  f"resubmit {msg.request_id}", 60.0)

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
