"""The scheduling policy: which requests matter most. It only orders; it never mutates.

The scheduler asks for two orders each step, most important first:
- order_running: running requests get token budget in this order, and the kvstore, when
  its pool runs dry, preempts from the tail of this order (least important first).
- order_waiting: waiting (new or preempted) requests are offered for admission in this
  order while the running limit and the token budget allow.

A policy returns a new list; it may leave requests out, and those are not scheduled this
step. It must not keep references to the requests between calls.
"""

from __future__ import annotations

import abc

from services.scheduler.request import Request


class SchedulingPolicy(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        """Waiting requests, the next to admit first."""

    @abc.abstractmethod
    def order_running(self, running: list[Request]) -> list[Request]:
        """Running requests, the last to preempt first."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: earliest arrival_time first, ties by arrival order."""

    name = "fcfs"

    @staticmethod
    def _arrival_key(request: Request) -> tuple[float, int]:
        return (request.arrival_time, request.arrival_seq)

    def order_waiting(self, waiting: list[Request]) -> list[Request]:
        return sorted(waiting, key=self._arrival_key)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self._arrival_key)
