"""Moving a dead worker's requests to survivors: they recompute prompt + output, like a preemption.
A fork parent with held children moves as a fresh copy, its children made again (same ids, seeds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.shared.messages import RequestDelta

if TYPE_CHECKING:
    from pagedserve.services.scheduler.scheduler import Scheduler


def release_all(sched: Scheduler) -> tuple[list[Request], list[RequestDelta]]:
    """Empty sched: (its live requests, most important first; the abort deltas it owed)."""
    sched.preempt_all()
    requests: list[Request] = []
    for request in sched._waiting:
        if request.is_fork_parent:
            sched._forks.drop(request.request_id)
            request = Request(request.request_id, request.prompt_token_ids, request.sampling,
                              request.eos_token_ids, request.arrival_time, request.priority, request.tenant,
                              request.cache_salt)
        requests.append(request)
    sched._requests.clear()
    sched._waiting.clear()
    sched._running.clear()
    sched._free_request_ids.clear()  # the dead pool is dropped whole
    sched._worker_finished_ids.clear()
    deltas, sched._abort_deltas = sched._abort_deltas, []
    return requests, deltas


def adopt(sched: Scheduler, request: Request) -> None:
    if request.is_fork_parent and request.status is RequestStatus.WAITING and not request.num_computed_tokens:
        sched.add_request(request)
        return
    if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or request.num_computed_tokens:
        raise ValueError(f"request {request.request_id!r} is {request.status.value}: only a waiting one moves")
    if request.request_id in sched._requests:
        raise ValueError(f"duplicate request id {request.request_id!r}")
    if request.num_tokens >= sched.max_model_len:
        raise ValueError(f"request {request.request_id!r} of {request.num_tokens} tokens exceeds max_model_len")
    request.arrival_seq = next(sched._arrival_seq)
    sched.grammars.want(request.sampling.guided)
    sched._requests[request.request_id] = request
    sched._waiting.append(request)
