"""The scheduling policy: orders requests and answers questions; never mutates them.

Plugins of the entry-point group `pagedserve.policies` (policies/registry.py), built as
`cls(**options)`; an unknown option raises PolicyError naming it. Asked once per step:
- order_waiting: admission order; order_running: budget order, preempted from the tail;
- may_displace(candidate, victim = tail of order_running): must be asymmetric, or two
  requests would trade places every step;
- admits(tenant, queue): may one more request of this tenant wait (admission.py).
Returns new lists (left-out requests are not scheduled this step); keeps no request references.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from services.scheduler.request import Request


class PolicyError(ValueError):
    """A policy that is not installed, or an option it does not take."""


@dataclass(frozen=True)
class TenantQueue:
    """What one tenant has in the waiting queue."""

    num_waiting: int = 0
    num_waiting_tokens: int = 0


@dataclass(frozen=True)
class QueueStats:
    """The waiting queue against its bounds (None: unbounded)."""

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
        """Whether waiting `candidate` may preempt running `victim` to take its place."""
        return False

    def admits(self, tenant: TenantQueue, queue: QueueStats) -> bool:
        """Whether one more request of a tenant with `tenant` waiting may join the queue."""
        return not queue.is_full

    def describe(self) -> dict:
        """Name and options, for stats and the admin route."""
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


def arrival_key(request: Request) -> tuple[float, int]:
    """Earliest arrival first; arrival_seq breaks ties between equal arrival times."""
    return (request.arrival_time, request.arrival_seq)


def take_options(policy: str, options: dict, defaults: dict[str, float]) -> dict[str, float]:
    """Numeric options of a policy: unknown names and non-numbers raise PolicyError naming them."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise PolicyError(f"policy {policy!r} takes no option {unknown[0]!r} (options: {sorted(defaults)})")
    out = dict(defaults)
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise PolicyError(f"policy {policy!r}: option {key!r}={value!r} must be a number >= 0")
        out[key] = type(defaults[key])(value)
    return out


def __getattr__(name: str):
    # lazy re-export of policies/fcfs.py's FCFSPolicy, avoiding an import cycle
    if name == "FCFSPolicy":
        from services.scheduler.policies.fcfs import FCFSPolicy

        return FCFSPolicy
    raise AttributeError(name)
