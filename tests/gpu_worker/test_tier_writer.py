"""The worker's tier writes on their own thread (services/gpu_worker/tier_writer.py): a result
waits exactly for the writes of the steps it names, in step order, and names the blocks written
(the kvstore makes them loadable then); a refused write is neither counted nor named."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import redis

from pagedserve.services.gpu_worker.tier_writer import TierWriter, writer_client
from pagedserve.shared import kv_tier
from pagedserve.shared.messages import StepResult
from pagedserve.shared.streams import Keys


class GatedClient:
    """A blocking client whose pipelines write only once `gate` is set (or fail with `error`)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.gate, self.error, self.written, self.closed = threading.Event(), error, [], False

    def pipeline(self, transaction: bool = True):
        client, sets = self, []

        class Pipe:
            def set(self, key, value):
                sets.append((key, bytes(value)))

            def execute(self):
                client.gate.wait()
                if client.error is not None:
                    raise client.error
                client.written.extend(sets)

        return Pipe()

    def close(self) -> None:
        self.closed = True


def blocks(*hashes: bytes) -> list[tuple[bytes, memoryview]]:
    return [(h, memoryview(h * 4)) for h in hashes]


def taken(writer: TierWriter) -> tuple[int, int]:
    result = StepResult(0)
    writer.tally.take_into(result)
    return result.num_tier_stored_blocks, result.tier_stored_bytes


def test_a_result_waits_for_the_writes_of_the_steps_up_to_the_one_it_names():
    client, released = GatedClient(), []
    writer = TierWriter(client, Keys("t"), "ns")

    async def scenario():
        writer.submit(1, blocks(b"a", b"b"), lambda: released.append(1))
        writer.submit(2, blocks(b"c"), lambda: released.append(2))
        await writer.wait_through(0, 5.0)  # names no step with writes: returns at once
        assert client.written == released == [] and writer.num_pending() == 2 and taken(writer) == (0, 0)
        assert writer.take_written() == []
        client.gate.set()
        await writer.wait_through(1, 5.0)
        written = writer.take_written()
        assert written[:2] == [b"a", b"b"]
        assert [key for key, _ in client.written][:2] == ["t:kvtier:ns:61", "t:kvtier:ns:62"]
        await writer.wait_through(2, 5.0)
        assert [value for _, value in client.written] == [b"aaaa", b"bbbb", b"cccc"]
        assert writer.num_pending() == 0 and taken(writer) == (3, 12) and taken(writer) == (0, 0)
        assert released == [1, 2] and written + writer.take_written() == [b"a", b"b", b"c"]
        assert writer.take_written() == []

    asyncio.run(scenario())
    writer.close()
    assert client.closed


def test_step_ids_that_start_again_after_a_scheduler_restart_are_still_waited_for():
    client = GatedClient()
    writer = TierWriter(client, Keys("t"), "ns")

    async def scenario():
        writer.submit(500, blocks(b"a"), lambda: None)
        writer.submit(1, blocks(b"b"), lambda: None)
        client.gate.set()
        await writer.wait_through(1, 5.0)  # in step order: step 500's write went first
        assert [value for _, value in client.written] == [b"aaaa", b"bbbb"] and writer.num_pending() == 0

    asyncio.run(scenario())
    writer.close()


def test_a_refused_write_is_logged_and_not_counted_and_frees_its_buffer():
    client, released = GatedClient(redis.exceptions.ConnectionError("gone")), []
    client.gate.set()
    writer = TierWriter(client, Keys("t"), "ns")

    async def scenario():
        writer.submit(1, blocks(b"a"), lambda: released.append(1))
        await writer.wait_through(1, 5.0)
        assert client.written == [] and taken(writer) == (0, 0) and released == [1]  # its buffer is free again
        assert writer.take_written() == []  # its reservation times out in the kvstore

    asyncio.run(scenario())
    writer.close()


def test_the_writer_client_sends_block_values_as_they_are_and_redis_holds_their_bytes():
    client = writer_client(os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0", 5.0)
    value = memoryview(bytearray(range(256)) * 40)
    chunks = client.connection_pool.get_connection().pack_commands([("SET", "k", value)])
    assert sum(chunk is value for chunk in chunks) == 1
    keys = Keys(f"test-writer-{uuid.uuid4().hex[:8]}")
    prefix = f"{keys.prefix}:kvtier:ns:"
    try:
        assert kv_tier.store_blocks(client, keys, "ns", [(b"\x01", value), (b"\x02", value[:7])])
        assert client.get(prefix + "01") == bytes(value) and client.get(prefix + "02") == bytes(range(7))
    finally:
        client.delete(prefix + "01", prefix + "02")
        client.close()
