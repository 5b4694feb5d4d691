"""Redis plumbing for the services' loops (never the pure cores): connect, streams, heartbeats, stats.

An entry that does not decode is returned with `error` set, so a bad message ends its
request, never the reader's loop; after a Redis restart, state kept only there is rewritten by its holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import io
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
import redis.exceptions

from pagedserve.shared.codec import CodecError, pack, unpack
from pagedserve.shared.config import ConfigError
from pagedserve.shared.redis_connect import async_client
from pagedserve.shared.redis_fast import execute, fast_client, streams_reply, xreadgroup
from pagedserve.shared.streams import DEFAULT_PREFIX, FIELD, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, Keys

log = logging.getLogger("pagedserve.redis")

DEFAULT_MAXLEN = 10_000  # entries kept per stream (approximate trim)
REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


def default_redis_url() -> str:
    return os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def add_common_arguments(parser) -> None:
    parser.add_argument("--redis-url", default=default_redis_url(),
                        help="Redis server (default: $REDIS_URL or redis://127.0.0.1:6379/0)")
    parser.add_argument("--prefix", default=os.environ.get("PAGEDSERVE_PREFIX") or DEFAULT_PREFIX,
                        help="key prefix of this stack (default: $PAGEDSERVE_PREFIX or pagedserve)")
    parser.add_argument("--log-level", default=os.environ.get("PAGEDSERVE_LOG_LEVEL") or "INFO",
                        help="DEBUG, INFO, WARNING or ERROR")


class Backoff:
    """Exponential delays: 0.1 s doubling up to `cap`; reset() after a success."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self._next = first, cap, first

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self.cap)
        return delay

    def reset(self) -> None:
        self._next = self.first


async def connect(url: str, timeout_s: float = 60.0) -> aioredis.Redis:
    """A client that has answered PING; retried with backoff, fatal after timeout_s."""
    client = async_client(url)
    backoff, deadline = Backoff(), time.monotonic() + timeout_s
    while True:
        try:
            await client.ping()
            return client
        except REDIS_ERRORS as e:
            if time.monotonic() > deadline:
                await client.aclose()
                raise ConnectionError(f"redis at {url} unreachable for {timeout_s:.0f}s: {e}") from e
            delay = backoff.next()
            log.warning("redis at %s unreachable (%s); retrying in %.1fs", url, e, delay)
            await asyncio.sleep(delay)


async def ensure_group(r: aioredis.Redis, stream: str, group: str, skip_backlog: bool = False) -> None:
    try:
        await r.xgroup_create(stream, group, id="$" if skip_backlog else "0", mkstream=True)
    except redis.exceptions.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
        if skip_backlog:
            await r.xgroup_setid(stream, group, "$")


def _xadd_of(stream: str, message: Any, maxlen: int = DEFAULT_MAXLEN) -> tuple:
    return "XADD", stream, "MAXLEN", "~", maxlen, "*", FIELD, pack(message)


async def send(r: aioredis.Redis, stream: str, message: Any, maxlen: int = DEFAULT_MAXLEN) -> bytes:
    return _raised(await execute(r, [_xadd_of(stream, message, maxlen)]))[0]


def _raised(replies: list) -> list:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _pipeline(r: aioredis.Redis, sends: Sequence[tuple[str, Any]]):
    pipe = r.pipeline(transaction=False)
    for stream, message in sends:
        pipe.xadd(stream, {FIELD: pack(message)}, maxlen=DEFAULT_MAXLEN, approximate=True)
    return pipe


async def send_all(r: aioredis.Redis, sends: Sequence[tuple[str, Any]]) -> None:
    """(stream, message) pairs sent in order, in one round trip."""
    if sends:
        _raised(await execute(r, [_xadd_of(stream, message) for stream, message in sends]))


class SendFailed(redis.exceptions.RedisError):
    """A send of read_group(sends=...) was refused; .entries: what its read returned, to handle first."""

    def __init__(self, error: Exception, entries: list[Entry]) -> None:
        super().__init__(str(error))
        self.entries = entries


@dataclass
class Entry:
    stream: str
    entry_id: bytes
    message: Any = None  # the decoded message, or None when error is set
    error: str | None = None
    raw: bytes | None = None


def _decode(stream: str, entry_id: bytes, fields: dict, expected: tuple[type, ...]) -> Entry:
    raw = (fields or {}).get(FIELD)  # None: a pending entry trimmed away meanwhile
    if raw is None:
        return Entry(stream, entry_id, error=f"no field {FIELD!r}")
    try:
        message = unpack(raw)
    except CodecError as e:
        return Entry(stream, entry_id, error=str(e), raw=raw)
    if not isinstance(message, expected):
        names = ", ".join(t.__name__ for t in expected)
        return Entry(stream, entry_id, error=f"expected {names}, got {type(message).__name__}", raw=raw)
    return Entry(stream, entry_id, message, raw=raw)


async def read_group(r: aioredis.Redis, group: str, consumer: str, streams: Mapping[str, tuple[type, ...]],
                     block_ms: int | None, count: int = 256, noack: bool = True,
                     pending: bool = False, sends: Sequence[tuple[str, Any]] = ()) -> list[Entry]:
    """New entries of `streams` (stream -> accepted types), decoded, acked unless noack=False;
    pending=True re-reads this consumer's unacknowledged entries. sends: send_all()'s pairs, sent
    first in the same round trip (a step's one message per hop, no round trip of its own)."""
    ids, block = {s: "0" if pending else ">" for s in streams}, None if pending else block_ms
    failed = None
    fast = fast_client(r)
    try:
        if fast is not None:
            *sent, reply = await fast.call([*(_xadd_of(stream, message) for stream, message in sends),
                                            xreadgroup(group, consumer, ids, count, block, noack)],
                                           (block or 0) / 1000)
            failed = next((x for x in sent if isinstance(x, Exception)), None)
            if isinstance(reply, Exception):
                raise failed or reply
            reply = streams_reply(reply)
        elif sends:
            pipe = _pipeline(r, sends)
            pipe.xreadgroup(group, consumer, ids, count=count, block=block, noack=noack)
            *sent, reply = await pipe.execute(raise_on_error=False)
            failed = next((x for x in sent if isinstance(x, Exception)), None)
            if isinstance(reply, Exception):
                raise failed or reply
        else:
            reply = await r.xreadgroup(group, consumer, ids, count=count, block=block, noack=noack)
    except redis.exceptions.ResponseError as e:
        if "NOGROUP" not in str(e):
            raise
        for stream in streams:  # the stream was deleted under us: recreate and read next time
            await ensure_group(r, stream, group)
        return []
    by_stream = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (reply or [])}
    entries = [_decode(stream, entry_id, fields, expected)
               for stream, expected in streams.items() for entry_id, fields in by_stream.get(stream) or []]
    if failed is not None:  # the read went through (and acked): its entries must not be lost with the error
        raise SendFailed(failed, entries)
    return entries


async def newest_per_worker(r: aioredis.Redis, stream: str, expected: type, count: int = 1000) -> list[tuple[bytes, Any]]:
    """The newest decodable entry of each worker_id among the last `count`, oldest first."""
    newest: dict[str, tuple[bytes, Any]] = {}
    for entry_id, fields in await r.xrevrange(stream, count=count):
        entry = _decode(stream, entry_id, fields, (expected,))
        if entry.error is None:
            newest.setdefault(entry.message.worker_id, (entry_id, entry.message))
    return sorted(newest.values(), key=lambda e: stream_id_tuple(e[0]))


def stream_id_tuple(entry_id: bytes | str) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def peek_step_id(raw: bytes | None) -> int | None:
    """The step_id of a message that did not decode, if it can be found at all."""
    try:
        step_id = msgpack.unpackb(raw, raw=False)["d"]["step_id"]
    except Exception:  # garbage of any shape
        return None
    return step_id if isinstance(step_id, int) and not isinstance(step_id, bool) else None


class Heartbeat:
    """SET keys.heartbeat(name) = incarnation PX ttl, every interval, until stop()."""

    def __init__(self, r: aioredis.Redis, keys: Keys, name: str, incarnation: str) -> None:
        self.r, self.key, self.incarnation = r, keys.heartbeat(name), incarnation
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """The first beat is written before this returns: peers may rely on its order."""
        await self._beat()
        self._task = asyncio.create_task(self._run(), name=f"heartbeat {self.key}")

    async def _beat(self) -> None:
        await self.r.set(self.key, self.incarnation, px=int(HEARTBEAT_TTL_S * 1000))

    async def start_beat(self) -> None:
        await self._beat()

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                await self._beat()
                if failing:
                    log.info("heartbeat %s: redis is back", self.key)
                failing = False
            except REDIS_ERRORS as e:
                if not failing:
                    log.error("heartbeat %s failed: %s (retrying)", self.key, e)
                failing = True

    async def stop(self) -> None:
        """Stop beating and delete the key (if it is still ours) so peers notice at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(*REDIS_ERRORS):
            if await self.r.get(self.key) == self.incarnation.encode():
                await self.r.delete(self.key)


async def server_run_id(r: aioredis.Redis) -> str:
    return (await r.info("server"))["run_id"]


class RunIdWatch:
    """changed() is True once per Redis restart seen (the first call only records the id)."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    async def changed(self, r: aioredis.Redis) -> bool:
        run_id = await server_run_id(r)
        old, self.run_id = self.run_id, run_id
        if old is not None and old != run_id:
            log.warning("redis restarted (run_id %s -> %s)", old[:8], run_id[:8])
            return True
        return False


async def on_restart(r: aioredis.Redis, callback: Callable[[], Awaitable[None]],
                     interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
    """Run for ever: await callback() after each Redis restart."""
    watch = RunIdWatch()
    while True:
        try:
            if await watch.changed(r):
                await callback()
        except REDIS_ERRORS as e:
            log.debug("restart watch: %s", e)
        await asyncio.sleep(interval_s)


async def accept_hello(r: aioredis.Redis, keys: Keys, seen: dict[str, tuple[int, int]], entry_id: bytes,
                       worker_id: str) -> tuple[bool, str | None]:
    """Whether a hello is newer than the last seen of its worker (then recorded in `seen`), and
    that worker's heartbeat incarnation (None: no heartbeat, the worker is gone)."""
    entry = stream_id_tuple(entry_id)
    if entry <= seen.get(worker_id, (0, 0)):
        return False, None
    seen[worker_id] = entry
    return True, await get_incarnation(r, keys, f"worker:{worker_id}")


async def get_incarnation(r: aioredis.Redis, keys: Keys, name: str) -> str | None:
    """A peer's incarnation id from its heartbeat, or None if it has none (dead/not started)."""
    value = await r.get(keys.heartbeat(name))
    return value.decode() if value is not None else None


async def write_stats(r: aioredis.Redis, keys: Keys, service: str, stats: dict) -> None:
    await r.set(keys.stats(service), msgpack.packb(stats, use_bin_type=True))


async def read_stats(r: aioredis.Redis, keys: Keys, service: str) -> dict | None:
    (data,) = await execute(r, [("GET", keys.stats(service))])  # read ten times a second
    if isinstance(data, Exception):
        raise data
    return msgpack.unpackb(data, raw=False) if data is not None else None


def setup_logging(level: str) -> None:
    """One line per event on stderr; an unknown level is a config error naming log_level."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not isinstance(logging.getLevelName(str(level).upper()), int):
        raise ConfigError(f"invalid config field 'log_level'={level!r}: one of DEBUG, INFO, WARNING, ERROR")
    logging.getLogger().setLevel(str(level).upper())


STOP_GRACE_S = 8.0  # after SIGTERM, how long main() gets to return before the service exits anyway


GC_YOUNG_THRESHOLD = 20_000  # tracked allocations between young collections (Python's default: 700)


def settle_gc() -> None:
    """For a started service: what exists now (modules, app, model) lives as long as the process, so full
    collections skip it; a step's short-lived messages die before a young collection, never promoted."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed (less CPU per message, CPU the worker needs), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_service(main: Callable[[asyncio.Event], Awaitable[int]], name: str) -> int:
    """Run main(stop); SIGTERM/SIGINT set `stop`, an exception exits 1. A stop is bounded:
    after STOP_GRACE_S the task stacks are logged and it exits 0; a stuck loop dies at twice that."""
    service_log = logging.getLogger(f"pagedserve.{name}")

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        task = asyncio.ensure_future(main(stop))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            faulthandler.dump_traceback_later(2 * STOP_GRACE_S, exit=True)
            done, _ = await asyncio.wait({task}, timeout=STOP_GRACE_S)
            if not done:
                service_log.error("%s did not stop within %.0fs of the signal; exiting anyway", name, STOP_GRACE_S)
                for t in asyncio.all_tasks():
                    if t is not asyncio.current_task():
                        buf = io.StringIO()
                        t.print_stack(file=buf)
                        service_log.error("task %s:\n%s", t.get_name(), buf.getvalue())
                os._exit(0)
        stopping.cancel()
        return task.result()

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as service_runner:
            code = service_runner.run(runner())
    except Exception as e:  # the one place a service dies: say why, exit non-zero
        service_log.critical("%s stopped by a fatal error: %s", name, e, exc_info=True)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    service_log.info("%s stopped (exit %d)", name, code)
    return code


def run_loop(redis_url: str, name: str, make_loop: Callable[[aioredis.Redis], Any]) -> int:
    async def main(stop: asyncio.Event) -> int:
        r = await connect(redis_url)
        try:
            return await make_loop(r).run(stop)
        finally:
            await r.aclose()

    return run_service(main, name)
