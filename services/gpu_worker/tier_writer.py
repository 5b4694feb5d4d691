"""The worker's tier writes, off the step's path: one thread with its own blocking Redis connection
writes each step's packed blocks in step order, never joining them into one bytes object."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Callable

import redis
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer

from pagedserve.services.gpu_worker.tier_blocks import StoreTally
from pagedserve.shared import kv_tier
from pagedserve.shared.redis_connect import sync_client
from pagedserve.shared.streams import Keys

PACKER_CUTOFF = 6000  # redis-py's: a larger argument goes to the socket on its own


def writer_client(redis_url: str, timeout_s: float) -> redis.Redis:
    """A blocking client that sends each block's memoryview as it is: the hiredis packer redis-py
    picks otherwise copies every value twice (bytes(), then the whole command)."""
    packer = PythonRespSerializer(PACKER_CUTOFF, Encoder("utf-8", "strict", False).encode)
    return sync_client(redis_url, socket_timeout=timeout_s, command_packer=packer)


class TierWriter:
    def __init__(self, client, keys: Keys, namespace: str) -> None:
        self._client, self._keys, self._namespace = client, keys, namespace
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier-writer")
        # (step id, eager, its writes), in step order; an eager write is waited for by its own step's result
        self._pending: deque[tuple[int, bool, asyncio.Future]] = deque()
        self.tally = StoreTally()
        self._written: list[bytes] = []
        self._filled: list[tuple[str, int, bytes]] = []

    def submit(self, step_id: int, blocks: list[tuple[bytes, memoryview]], done: Callable[[], None],
               eager: bool = False, filled: list[tuple[str, int, bytes]] = ()) -> None:
        """Write a step's blocks after those submitted before; done() once written or not. The last len(filled) are fills."""
        num_bytes = sum(len(contents) for _h, contents in blocks)
        future = asyncio.wrap_future(self._thread.submit(self._write, blocks))
        num_planned = len(blocks) - len(filled)

        def count(written: asyncio.Future) -> None:
            done()
            seconds = None if written.cancelled() or written.exception() else written.result()
            if seconds is not None:
                self.tally.add(len(blocks), num_bytes, seconds)
                self._written.extend(block_hash for block_hash, _contents in blocks[:num_planned])
                self._filled.extend(filled)

        future.add_done_callback(count)
        self._pending.append((step_id, eager, future))

    def _write(self, blocks: list[tuple[bytes, memoryview]]) -> float | None:
        started = time.perf_counter()
        if kv_tier.store_blocks(self._client, self._keys, self._namespace, blocks):
            return time.perf_counter() - started
        return None

    async def wait_through(self, step_id: int, timeout_s: float, eager_step: int | None = None) -> None:
        def is_due(step: int, eager: bool) -> bool:
            return step <= step_id or (eager and step == eager_step)

        due = [future for step, eager, future in self._pending if is_due(step, eager) and not future.done()]
        # step ids restart with a restarted scheduler: a write is forgotten once done, not by order
        self._pending = deque((step, eager, f) for step, eager, f in self._pending
                              if not is_due(step, eager) and not f.done())
        if due:
            await asyncio.wait(due, timeout=timeout_s)

    def take_written(self) -> list[bytes]:
        written, self._written = self._written, []
        return written

    def take_filled(self) -> list[tuple[str, int, bytes]]:
        filled, self._filled = self._filled, []
        return filled

    def num_pending(self) -> int:
        return sum(not future.done() for _step, _eager, future in self._pending)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._client.close()
