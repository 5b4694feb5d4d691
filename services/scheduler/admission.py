"""Admission table (the policy's answer per tenant) for the stats blob: the api answers 429 from it,
so the bound lags by one refresh; the scheduler never refuses a request it was sent.
"""

from __future__ import annotations

from collections import defaultdict

from pagedserve.services.scheduler.policy import QueueStats, SchedulingPolicy, TenantQueue
from pagedserve.services.scheduler.request import Request


def queue_stats(waiting: list[Request], max_waiting_requests: int | None,
                max_waiting_tokens: int | None) -> QueueStats:
    """What each waiting request may still cost: its known tokens plus its max_tokens left."""
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
