"""priority: higher `priority` first, ties by arrival. A waiting request displaces a running one
of strictly lower priority (strictly: no ping-pong between equals or back)."""

from __future__ import annotations

from pagedserve.services.scheduler.policy import KeyedPolicy, arrival_key
from pagedserve.services.scheduler.request import Request


def _key(request: Request) -> tuple[int, float, int]:
    return (-request.priority, *arrival_key(request))


class PriorityPolicy(KeyedPolicy):
    name = "priority"
    sort_key = staticmethod(_key)

    def may_displace(self, candidate: Request, victim: Request, running: list[Request]) -> bool:
        return candidate.priority > victim.priority
