"""The scheduling policy: orders requests, never mutates them or keeps references; returns new lists.

may_displace must be asymmetric, or two requests would trade places every step.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from pagedserve.services.scheduler.request import Request


class PolicyError(ValueError):
    """A policy that is not installed, or an option it does not take."""


@dataclass(frozen=True)
class TenantQueue:
    num_waiting: int = 0
    num_waiting_tokens: int = 0


@dataclass(frozen=True)
class QueueStats:
    num_waiting: int
    num_waiting_tokens: int
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    num_tenants_waiting: int = 0
    tenants: dict[str | None, TenantQueue] = field(default_factory=dict)

    @property
    def is_full(self) -> bool:
        return (self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests) or (
            self.max_waiting_tokens is not None and self.num_waiting_tokens >= self.max_waiting_tokens)


class SchedulingPolicy(abc.ABC):
    name: str = "abstract"

    def __init__(self, **options) -> None:
        if options:
            raise PolicyError(f"policy {self.name!r} takes no option {sorted(options)[0]!r}")

    @abc.abstractmethod
    def order_waiting(self, waiting: list[Request], running: list[Request]) -> list[Request]:
        """Waiting requests, the next to admit first."""

    @abc.abstractmethod
    def order_running(self, running: list[Request]) -> list[Request]:
        """Running requests, the last to preempt first."""

    def may_displace(self, candidate: Request, victim: Request, running: list[Request]) -> bool:
        return False

    def admits(self, tenant: TenantQueue, queue: QueueStats) -> bool:
        return not queue.is_full

    def describe(self) -> dict:
        return {"name": self.name, "options": {}}


class KeyedPolicy(SchedulingPolicy):
    """Waiting and running requests in one order: ascending sort_key(request)."""

    @staticmethod
    @abc.abstractmethod
    def sort_key(request: Request) -> tuple:
        """The request's rank; lowest is admitted first and preempted last."""

    def order_waiting(self, waiting: list[Request], running: list[Request] = ()) -> list[Request]:
        return sorted(waiting, key=self.sort_key)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self.sort_key)


def displacement_reach(policy: SchedulingPolicy, waiting: list[Request], running: list[Request],
                       num_free_seqs: int) -> list[int]:
    """The policy's displacement as data: per waiting request offered, the index into running it
    stands before (the kvstore's alloc step takes those after it, tail first; past the seats: the tail)."""
    survivors = list(running)  # those a seatless earlier request has not taken
    planned: list[Request] = []
    reach: list[int] = []
    floor = 0
    for candidate in waiting:
        num_taken = 0
        while (len(survivors) - num_taken > floor
               and policy.may_displace(candidate, survivors[len(survivors) - num_taken - 1],
                                       survivors[:len(survivors) - num_taken] + planned
                                       + ([candidate] if num_taken else []))):
            num_taken += 1
        floor = len(survivors) - num_taken
        if num_free_seqs > 0:
            num_free_seqs -= 1
        elif num_taken:
            survivors.pop()
        else:
            break
        planned.append(candidate)
        reach.append(floor)
    return reach


def arrival_key(request: Request) -> tuple[float, int]:
    return (request.arrival_time, request.arrival_seq)


def take_options(policy: str, options: dict, defaults: dict[str, float]) -> dict[str, float]:
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise PolicyError(f"policy {policy!r} takes no option {unknown[0]!r} (options: {sorted(defaults)})")
    out = dict(defaults)
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise PolicyError(f"policy {policy!r}: option {key!r}={value!r} must be a number >= 0")
        out[key] = type(defaults[key])(value)
    return out

