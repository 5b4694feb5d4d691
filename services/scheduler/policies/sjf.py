"""sjf: shortest expected work first, with aging so nothing starves.

Expected work of a request = tokens it still has to compute (prompt not yet in the pool,
or all of it again after a preemption) + tokens it may still generate (max_tokens left).
A waiting request's key is its expected work minus `aging` tokens for every step it has
waited, so a long request's key falls below any newcomer's after
(its work - the shortest possible work) / aging steps: it cannot starve. Running requests
are ordered by expected work alone: the one with the most work left is preempted first.
SJF never displaces a running request (only slots freed by finished ones are handed out).

The only state is a step counter and the step each waiting request id was first seen at
(ids, not requests); a request that leaves the waiting queue is forgotten, so a
preempted one ages afresh.
"""

from __future__ import annotations

from services.scheduler.policy import SchedulingPolicy, arrival_key, take_options
from services.scheduler.request import Request

DEFAULT_AGING = 1.0  # tokens of expected work forgiven per step waited


def expected_work(request: Request) -> int:
    to_compute = request.num_tokens - request.num_computed_tokens
    return to_compute + max(0, request.sampling.max_tokens - request.num_output_tokens)


class SJFPolicy(SchedulingPolicy):
    name = "sjf"

    def __init__(self, **options) -> None:
        self.aging = take_options(self.name, options, {"aging": DEFAULT_AGING})["aging"]
        self._step = 0
        self._first_seen: dict[str, int] = {}

    def describe(self) -> dict:
        return {"name": self.name, "options": {"aging": self.aging}}

    def effective_work(self, request: Request) -> float:
        waited = self._step - self._first_seen.get(request.request_id, self._step)
        return expected_work(request) - self.aging * waited

    def order_waiting(self, waiting: list[Request], running: list[Request] = ()) -> list[Request]:
        self._step += 1
        first_seen = {r.request_id: self._first_seen.get(r.request_id, self._step) for r in waiting}
        self._first_seen = first_seen
        return sorted(waiting, key=lambda r: (self.effective_work(r), *arrival_key(r)))

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=lambda r: (expected_work(r), *arrival_key(r)))
