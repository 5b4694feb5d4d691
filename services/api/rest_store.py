"""State of REST-submitted requests (POST /v1/requests), kept in this api process.

Each record is driven to its end by a task of its own, whoever is watching; followers
(GET .../stream) replay what it has so far and then get each change. Finished records are
kept for a while, bounded in count and age, so a poll after the end still answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from services.api.generation import Generation, Output


class RestRecord:
    def __init__(self, gen: Generation):
        self.gen = gen
        self.outputs: list[Output] = []
        self.finished_at: float | None = None
        self._changed = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def status(self) -> str:
        if self.gen.finished:
            return "aborted" if self.gen.finish_reason == "abort" else "finished"
        return "running" if self.gen.started else "queued"

    def snapshot(self) -> dict:
        gen = self.gen
        return {"request_id": gen.request_id, "object": "request", "created": gen.created, "model": gen.prepared.model,
                "status": self.status, "text": gen.text, "token_ids": list(gen.token_ids),
                "finish_reason": gen.finish_reason, "usage": gen.usage()}

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def drive(self) -> None:
        try:
            while (out := await self.gen.next()) is not None:
                self.outputs.append(out)
                self._notify()
        finally:
            self.gen.close("api shutdown")
            if not self.outputs or self.outputs[-1].finish_reason is None:
                self.outputs.append(Output("", [], finish_reason=self.gen.finish_reason))
            self.finished_at = time.monotonic()
            self._notify()

    async def follow(self) -> AsyncIterator[Output]:
        """Everything so far as one Output, then one merged Output per change; the last
        one carries the finish reason."""
        index = 0
        while True:
            changed = self._changed
            if index < len(self.outputs):
                pending, index = self.outputs[index:], len(self.outputs)
                yield Output("".join(o.text for o in pending), [t for o in pending for t in o.token_ids],
                             [lp for o in pending for lp in o.logprobs], pending[-1].finish_reason)
                continue
            if self.done:
                return
            await changed.wait()


class RestStore:
    def __init__(self, max_finished: int = 1024, finished_ttl_s: float = 900.0):
        self.max_finished = max_finished
        self.finished_ttl_s = finished_ttl_s
        self._records: OrderedDict[str, RestRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def add(self, gen: Generation) -> RestRecord:
        """Track a started generation and drive it to its end in the background."""
        self.prune()
        record = RestRecord(gen)
        self._records[gen.request_id] = record
        record.task = asyncio.create_task(record.drive(), name=f"rest-{gen.request_id}")
        record.task.add_done_callback(lambda _t: self.prune())
        return record

    def get(self, request_id: str) -> RestRecord | None:
        return self._records.get(request_id)

    def prune(self) -> None:
        """Drop finished records past the age limit, then the oldest past the count limit."""
        now = time.monotonic()
        finished = [(rid, r) for rid, r in self._records.items() if r.done]
        excess = len(finished) - self.max_finished
        for i, (rid, record) in enumerate(finished):
            if i < excess or now - record.finished_at > self.finished_ttl_s:
                del self._records[rid]

    async def close(self) -> None:
        tasks = [r.task for r in self._records.values() if r.task is not None and not r.task.done()]
        for record in self._records.values():
            record.gen.abort("api shutdown")
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
