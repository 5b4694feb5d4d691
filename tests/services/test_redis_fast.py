"""The lean Redis client (shared/redis_fast.py): the same entries and errors as redis-py's path,
a connection lost or cut off mid-call never reused, and redis-py kept where it does not apply."""

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from pagedserve.shared import redis_io
from pagedserve.shared.messages import AllocReply, StepResult
from pagedserve.shared.redis_connect import async_client
from pagedserve.shared.redis_fast import execute, fast_client
from pagedserve.shared.streams import FIELD
from tests.services.conftest import REDIS_URL, delete_prefix


@pytest.fixture
def prefix():
    name = f"test-fast-{uuid.uuid4().hex[:8]}"
    yield name
    delete_prefix(name)


async def _read_both_ways(prefix: str) -> tuple[list, list]:
    fast, slow = async_client(REDIS_URL), async_client(REDIS_URL)
    stream = f"{prefix}:s"
    try:
        assert fast_client(fast) is not None
        await redis_io.ensure_group(fast, stream, "g")
        await redis_io.send_all(fast, [(stream, StepResult(1, [])), (stream, AllocReply(2, worker_id="w"))])
        await fast.xadd(stream, {b"other": b"x"})  # no message field: an entry with an error
        read = await redis_io.read_group(fast, "g", "c", {stream: (StepResult, AllocReply)}, 10, noack=False)
        slow.connection_pool.connection_class = type("Other", (aioredis.Connection,), {})  # not plain: redis-py
        assert fast_client(slow) is None
        again = await redis_io.read_group(slow, "g", "c", {stream: (StepResult, AllocReply)}, None, pending=True)
        return [(e.entry_id, e.message, e.error) for e in read], [(e.entry_id, e.message, e.error) for e in again]
    finally:
        await fast.aclose()
        await slow.aclose()


def test_entries_read_as_redis_py_reads_them(prefix):
    read, again = asyncio.run(_read_both_ways(prefix))
    assert [(m.step_id, e) for _id, m, e in read[:2]] == [(1, None), (2, None)]
    assert read[2][1] is None and read[2][2] == f"no field {FIELD!r}"
    assert again == read


async def _until(condition, timeout: float = 30.0) -> None:
    """Turns of this loop until condition() holds (callbacks on this loop make it so)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


async def _errors_and_reuse(prefix: str) -> None:
    r = async_client(REDIS_URL)
    client = fast_client(r)
    try:
        await r.set(f"{prefix}:str", "x")
        reply, count = await execute(r, [("XADD", f"{prefix}:str", "*", "f", "v"), ("EXISTS", f"{prefix}:str")])
        assert isinstance(reply, redis.exceptions.ResponseError) and "WRONGTYPE" in str(reply) and count == 1
        (conn,) = client._idle
        conn.transport.abort()  # lost while idle: a new connection serves the next call
        await _until(lambda: conn.closed)  # its connection_lost runs on a later turn of the loop
        assert await execute(r, [("PING",)]) == [b"PONG"] and client._idle[0] is not conn
        read = asyncio.ensure_future(client.call([("BLPOP", f"{prefix}:empty", 5)], 5.0))
        await _until(lambda: not client._idle)  # it took the connection and sent: it waits 5 s for a reply
        read.cancel()  # cut off mid-call: its reply would come to the next caller, so it is closed
        with pytest.raises(asyncio.CancelledError):
            await read
        assert client._idle == [] and await execute(r, [("PING",)]) == [b"PONG"]
    finally:
        await r.aclose()


def test_error_replies_lost_and_cancelled_connections(prefix):
    asyncio.run(_errors_and_reuse(prefix))
