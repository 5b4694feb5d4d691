"""fcfs: earliest arrival first, latest preempted first; never displaces a running request."""

from __future__ import annotations

from services.scheduler.policy import SchedulingPolicy, arrival_key
from services.scheduler.request import Request


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def order_waiting(self, waiting: list[Request], running: list[Request] = ()) -> list[Request]:
        return sorted(waiting, key=arrival_key)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=arrival_key)
