"""The scheduling policy: which requests matter most. It only orders and answers; it never
mutates a request or a queue.

Policies are plugins found through the entry-point group `pagedserve.policies` (see
services.scheduler.policies.registry); the built-ins are registered there exactly like
third-party ones. A policy is built as `cls(**options)` and must refuse an unknown option
with PolicyError naming it.

The scheduler asks, once per step and between steps only:
- order_waiting(waiting, running): waiting (new or preempted) requests are offered for
  admission in this order while the running limit and the token budget allow;
- order_running(running): running requests get token budget in this order, and the
  kvstore, when its pool runs dry, preempts from the tail of this order (least important
  first), so the policy decides the victims by ordering;
- may_displace(candidate, victim, running): whether a waiting request may preempt a
  running one to take its place, when no sequence slot is free or the pool refused the
  candidate last step. The victim is always the tail of order_running. A policy that
  allows it must make it asymmetric (if a may displace b, b may not displace a at once),
  or two requests would trade places every step;
- admits(tenant, queue): admission control, whether one more request of this tenant may
  join the waiting queue (the api asks before it opens any stream; see admission.py).

A policy returns new lists; it may leave requests out, and those are not scheduled this
step. It must not keep references to requests between calls (ids and numbers are fine).
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
    # FCFSPolicy lives in policies/fcfs.py; this keeps `from services.scheduler.policy
    # import FCFSPolicy` working without an import cycle.
    if name == "FCFSPolicy":
        from services.scheduler.policies.fcfs import FCFSPolicy

        return FCFSPolicy
    raise AttributeError(name)
