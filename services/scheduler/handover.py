"""Handing live requests from one worker's Scheduler to another's (migration).

The scheduler service keeps one Scheduler per worker (services/scheduler/loop.py). When a
worker's lease expires, release_all() takes every live request out of its Scheduler as
waiting, holding nothing (the dead pool is dropped whole by the kvstore, the worker is
gone), and adopt() queues each on a survivor, which recomputes prompt + output so far
(like a preemption): the api's stream goes on from the tokens it was already sent.

A fork parent (n > 1) whose children are still held is handed over as a fresh copy: the
receiving Scheduler makes its children again (same ids, same seeds). Children already
forked are plain requests and move as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.request import Request, RequestStatus
from shared.messages import RequestDelta

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


def release_all(sched: Scheduler) -> tuple[list[Request], list[RequestDelta]]:
    """Empty sched: (its live requests, most important running ones first, then waiting;
    the abort deltas it still owed the api). It is left with nothing to step."""
    sched.preempt_all()  # open steps abandoned; running -> front of waiting, in policy order
    requests: list[Request] = []
    for request in sched._waiting:
        if request.is_fork_parent:
            sched._forks.drop(request.request_id)  # its held children are made again on adoption
            request = Request(request.request_id, request.prompt_token_ids, request.sampling,
                              request.eos_token_ids, request.arrival_time, request.priority, request.tenant,
                              request.cache_salt)
        requests.append(request)
    sched._requests.clear()
    sched._waiting.clear()
    sched._running.clear()
    sched._free_request_ids.clear()  # the dead pool is dropped whole
    sched._worker_finished_ids.clear()
    sched._refused_ids = set()
    deltas, sched._abort_deltas = sched._abort_deltas, []
    return requests, deltas


def adopt(sched: Scheduler, request: Request) -> None:
    """Queue a request released by another worker's Scheduler; ValueError if it cannot run here."""
    if request.is_fork_parent and request.status is RequestStatus.WAITING and not request.num_computed_tokens:
        sched.add_request(request)  # fresh: its children are made here
        return
    if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or request.num_computed_tokens:
        raise ValueError(f"request {request.request_id!r} is {request.status.value}: only a waiting one moves")
    if request.request_id in sched._requests:
        raise ValueError(f"duplicate request id {request.request_id!r}")
    if request.num_tokens >= sched.max_model_len:
        raise ValueError(f"request {request.request_id!r} of {request.num_tokens} tokens exceeds max_model_len")
    request.arrival_seq = next(sched._arrival_seq)
    sched._requests[request.request_id] = request
    sched._waiting.append(request)
