"""Admission control, the scheduler's half: the waiting queue against its bounds, and the
policy's answer per tenant, published in the stats blob for the api to enforce.

The api must refuse (429) before it opens any stream, so it cannot wait for the
scheduler's verdict on each request: it reads this table (refreshed every stats write,
~20 times a second while busy) and answers from it. The bound is therefore approximate by
what the apis admit in one refresh; the scheduler never refuses a request it was sent
(a refusal there would reach a client as an abort after its stream opened).

Table on the wire (msgpack): {"admits": bool for a tenant with nothing waiting,
"tenants": [[tenant, bool], ...] only where a waiting tenant's answer differs,
"num_waiting", "num_waiting_tokens", "max_waiting_requests", "max_waiting_tokens"}.
"""

from __future__ import annotations

from collections import defaultdict

from services.scheduler.policy import QueueStats, SchedulingPolicy, TenantQueue
from services.scheduler.request import Request


def queue_stats(waiting: list[Request], max_waiting_requests: int | None,
                max_waiting_tokens: int | None) -> QueueStats:
    """Waiting tokens count what each request may still cost: prompt (or all tokens
    known, after a preemption) plus its max_tokens left."""
    counts: defaultdict[str | None, list[int]] = defaultdict(lambda: [0, 0])
    total_tokens = 0
    for request in waiting:
        num_tokens = request.num_tokens + max(0, request.sampling.max_tokens - request.num_output_tokens)
        counts[request.tenant][0] += 1
        counts[request.tenant][1] += num_tokens
        total_tokens += num_tokens
    tenants = {tenant: TenantQueue(n, t) for tenant, (n, t) in counts.items()}
    return QueueStats(len(waiting), total_tokens, max_waiting_requests, max_waiting_tokens, len(tenants), tenants)


def admission_table(policy: SchedulingPolicy, queue: QueueStats) -> dict:
    admits_new = bool(policy.admits(TenantQueue(), queue))
    differing = [[tenant, not admits_new] for tenant, tq in queue.tenants.items()
                 if bool(policy.admits(tq, queue)) != admits_new]
    return {"admits": admits_new, "tenants": differing, "num_waiting": queue.num_waiting,
            "num_waiting_tokens": queue.num_waiting_tokens, "max_waiting_requests": queue.max_waiting_requests,
            "max_waiting_tokens": queue.max_waiting_tokens}
