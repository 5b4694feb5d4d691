"""A lean RESP2 client for the services' per-step round trips: hiredis on an asyncio protocol.

redis-py's asyncio client spends about 200 us of Python on a round trip (pipeline objects,
retries, event hooks, its own stream reader); this one about 45 us, and each hop runs several a
step. It is made from a redis-py client's pool settings (plain TCP or a unix socket: no TLS, no
Sentinel, no credential provider; those stay on redis-py) and raises redis-py's errors
(ConnectionError, TimeoutError, ResponseError as a reply value), so the callers' retries hold.
A connection whose call did not finish (cancelled, timed out, lost) is closed, never reused.
"""

from __future__ import annotations

import asyncio
import collections
import weakref

import hiredis
import redis.asyncio as aioredis
import redis.exceptions

_PLAIN = (aioredis.Connection, aioredis.UnixDomainSocketConnection)
_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Conn(asyncio.Protocol):
    """One connection: requests are written at once, replies matched to them in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=redis.exceptions.ResponseError)
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiters:
            reply = self.reader.gets()
            if reply is False:
                return
            future = self.waiters.popleft()
            if not future.done():
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                future.set_exception(redis.exceptions.ConnectionError(f"redis connection lost: {exc}"))

    def request(self, packed: bytes, count: int) -> list[asyncio.Future]:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise redis.exceptions.ConnectionError("redis connection closed")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(count)]
        self.waiters.extend(futures)
        self.transport.write(packed)
        return futures

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            try:
                self.transport.close()
            except RuntimeError:  # its loop is closed already: so is the socket
                pass


class FastClient:
    def __init__(self, kwargs: dict, unix: bool) -> None:
        self.path = kwargs.get("path") if unix else None
        self.host, self.port = kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)
        self.db, self.password, self.username = kwargs.get("db") or 0, kwargs.get("password"), kwargs.get("username")
        self.socket_timeout = kwargs.get("socket_timeout")
        self.connect_timeout = kwargs.get("socket_connect_timeout") or self.socket_timeout
        self._idle: list[_Conn] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # the idle connections' loop

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.path is not None:
                    _, conn = await loop.create_unix_connection(_Conn, self.path)
                else:
                    _, conn = await loop.create_connection(_Conn, self.host, self.port)
        except TimeoutError as e:
            raise redis.exceptions.TimeoutError("timed out connecting to redis") from e
        hello = ([("AUTH", *((self.username,) if self.username else ()), self.password)] if self.password else []) + \
            ([("SELECT", self.db)] if self.db else [])
        try:
            for reply in await self._on(conn, hello, self.socket_timeout) if hello else []:
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            conn.close()
            raise
        return conn

    async def _on(self, conn: _Conn, commands: list[tuple], timeout_s: float | None) -> list:
        futures = conn.request(b"".join(hiredis.pack_command(c) for c in commands), len(commands))
        try:
            async with asyncio.timeout(timeout_s):
                return [await f for f in futures]
        except TimeoutError as e:
            raise redis.exceptions.TimeoutError("redis did not answer in time") from e

    async def call(self, commands: list[tuple], block_s: float = 0.0) -> list:
        """The replies of `commands`, sent in one write (an error reply is a ResponseError value)."""
        if self._loop is not asyncio.get_running_loop():  # a client used from a new loop: start afresh
            self.close()
            self._loop = asyncio.get_running_loop()
        while self._idle and self._idle[-1].closed:  # lost while idle (a Redis restart): not reused
            self._idle.pop()
        conn = self._idle.pop() if self._idle else await self._connect()
        done = False
        try:
            timeout = None if self.socket_timeout is None else self.socket_timeout + block_s
            replies = await self._on(conn, commands, timeout)
            done = True
            return replies
        finally:
            if done and not conn.closed:
                self._idle.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def fast_client(r) -> FastClient | None:
    """The lean client beside redis-py client `r` (one per client), or None where it does not apply."""
    try:
        return _CLIENTS[r]
    except (KeyError, TypeError):
        pass
    pool = getattr(r, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", {})
    plain = (type(pool) in (aioredis.ConnectionPool, aioredis.BlockingConnectionPool)
             and getattr(pool, "connection_class", None) in _PLAIN and not kwargs.get("credential_provider"))
    client = FastClient(kwargs, pool.connection_class is aioredis.UnixDomainSocketConnection) if plain else None
    try:
        _CLIENTS[r] = client
    except TypeError:
        return None
    if client is not None:
        weakref.finalize(r, client.close)
    return client


async def execute(r, commands: list[tuple]) -> list:
    """Raw commands in one round trip; their replies, an error reply as its exception (not raised)."""
    fast = fast_client(r)
    if fast is not None:
        return await fast.call(list(commands))
    pipe = r.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return await pipe.execute(raise_on_error=False)


def xreadgroup(group: str, consumer: str, ids: dict[str, str], count: int, block: int | None, noack: bool) -> tuple:
    return ("XREADGROUP", "GROUP", group, consumer, "COUNT", count, *(("BLOCK", block) if block is not None else ()),
            *(("NOACK",) if noack else ()), "STREAMS", *ids, *ids.values())


def streams_reply(reply) -> list:
    """XREADGROUP's RESP2 reply as redis-py gives it: [(stream, [(id, {field: value} or None)])]."""
    return [(stream, [(entry_id, None if fields is None else dict(zip(fields[::2], fields[1::2], strict=True)))
                      for entry_id, fields in entries]) for stream, entries in reply or []]
