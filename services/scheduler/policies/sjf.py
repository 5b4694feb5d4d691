"""sjf: shortest expected work (tokens to compute + max_tokens left) first; waiting requests age by
`aging` tokens per step so none starves (a preempted one ages afresh); never displaces.
"""

from __future__ import annotations

from pagedserve.services.scheduler.policy import SchedulingPolicy, arrival_key, take_options
from pagedserve.services.scheduler.request import Request

DEFAULT_AGING = 1.0


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
