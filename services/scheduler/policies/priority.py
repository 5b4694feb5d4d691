"""priority: the request's `priority` field, higher first; ties by arrival.

A waiting request may displace a running one of strictly lower priority, also when the
running limit is reached (the victim is the latest arrival of the lowest priority running).
Strictly lower, so two requests of equal priority never trade places (no ping-pong), and
a displaced request cannot displace its displacer back.
"""

from __future__ import annotations

from services.scheduler.policy import SchedulingPolicy, arrival_key
from services.scheduler.request import Request


def _key(request: Request) -> tuple[int, float, int]:
    return (-request.priority, *arrival_key(request))


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def order_waiting(self, waiting: list[Request], running: list[Request] = ()) -> list[Request]:
        return sorted(waiting, key=_key)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=_key)

    def may_displace(self, candidate: Request, victim: Request, running: list[Request]) -> bool:
        return candidate.priority > victim.priority
