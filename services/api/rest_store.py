"""State of REST-submitted requests (POST /v1/requests), kept in this api process.

Each record is driven to its end by a task of its own, whoever is watching; followers
(GET .../stream) replay what it has so far and then get each change. Finished records are
kept for a while, bounded in count and age, so a poll after the end still answers.

A record is the request's Choices (`n` >= 1 sequences); its snapshot has `choices` (index,
text, token_ids, finish_reason of each) and, for n == 1, that one choice's fields at the
top level too.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from services.api.choices import Choices
from services.api.generation import Output


async def _never_disconnected() -> bool:
    return False  # a REST request outlives its client: only DELETE aborts it


def merged(outputs: list[Output]) -> Output:
    """Several outputs of one choice as one; the last one's finish reason."""
    return Output("".join(o.text for o in outputs), [t for o in outputs for t in o.token_ids],
                  [lp for o in outputs for lp in o.logprobs], outputs[-1].finish_reason)


class RestRecord:
    def __init__(self, choices: Choices):
        self.choices = choices
        self.outputs: list[tuple[int, Output]] = []  # (choice index, output), as they came
        self.finished_at: float | None = None
        self._changed = asyncio.Event()
        self.task: asyncio.Task | None = None

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def status(self) -> str:
        gens = self.choices.gens
        if all(gen.finished for gen in gens):
            return "aborted" if any(gen.finish_reason == "abort" for gen in gens) else "finished"
        return "running" if any(gen.started for gen in gens) else "queued"

    def snapshot(self) -> dict:
        c = self.choices
        per_choice = [{"index": i, "text": gen.text, "token_ids": list(gen.token_ids),
                       "finish_reason": gen.finish_reason} for i, gen in enumerate(c.gens)]
        body = {"request_id": c.request_id, "object": "request", "created": c.created, "model": c.prepared.model,
                "status": self.status}
        if len(per_choice) == 1:
            body.update({k: per_choice[0][k] for k in ("text", "token_ids", "finish_reason")})
        return {**body, "choices": per_choice, "usage": c.usage()}

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def drive(self) -> None:
        try:
            async for index, out in self.choices.outputs(_never_disconnected):
                self.outputs.append((index, out))
                self._notify()
        finally:
            self.choices.close("api shutdown")
            ended = {index for index, out in self.outputs if out.finish_reason is not None}
            for index, gen in enumerate(self.choices.gens):
                if index not in ended:
                    self.outputs.append((index, Output("", [], finish_reason=gen.finish_reason)))
            self.finished_at = time.monotonic()
            self._notify()

    async def follow(self) -> AsyncIterator[tuple[int, Output]]:
        """Everything so far as one Output per choice, then one merged Output per choice
        per change; a choice's last one carries its finish reason."""
        seen = 0
        while True:
            changed = self._changed
            if seen < len(self.outputs):
                pending, seen = self.outputs[seen:], len(self.outputs)
                for index in dict.fromkeys(i for i, _ in pending):  # in order of first appearance
                    yield index, merged([out for i, out in pending if i == index])
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

    def add(self, choices: Choices) -> RestRecord:
        """Track a started request and drive it to its end in the background."""
        self.prune()
        record = RestRecord(choices)
        self._records[choices.request_id] = record
        record.task = asyncio.create_task(record.drive(), name=f"rest-{choices.request_id}")
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
            record.choices.close("api shutdown")
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
