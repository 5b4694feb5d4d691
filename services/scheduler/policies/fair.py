"""fair: a fair share of running slots and KV per tenant, stateless; a tenant running s ranks its
i-th waiting request s + i; displace when s_candidate + 1 < s_victim (never reversed at once); past the
queue bound a tenant under bound / tenants is still admitted (the queue stays below twice its bound).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pagedserve.services.scheduler.policy import QueueStats, SchedulingPolicy, TenantQueue, arrival_key
from pagedserve.services.scheduler.request import Request


def _num_running(running: list[Request]) -> Counter:
    return Counter(r.tenant for r in running)


class FairPolicy(SchedulingPolicy):
    name = "fair"

    def order_waiting(self, waiting: list[Request], running: list[Request] = ()) -> list[Request]:
        num_running = _num_running(running)
        by_tenant: defaultdict[str | None, list[Request]] = defaultdict(list)
        for request in sorted(waiting, key=arrival_key):
            by_tenant[request.tenant].append(request)
        keyed = [(num_running[tenant] + i, *arrival_key(r), r)
                 for tenant, requests in by_tenant.items() for i, r in enumerate(requests)]
        return [entry[-1] for entry in sorted(keyed, key=lambda e: e[:-1])]

    def order_running(self, running: list[Request]) -> list[Request]:
        held: Counter = Counter()
        keyed = []
        for request in sorted(running, key=arrival_key):
            held[request.tenant] += request.num_tokens
            keyed.append((held[request.tenant], *arrival_key(request), request))
        return [entry[-1] for entry in sorted(keyed, key=lambda e: e[:-1])]

    def may_displace(self, candidate: Request, victim: Request, running: list[Request]) -> bool:
        num_running = _num_running(running)
        return candidate.tenant != victim.tenant and num_running[candidate.tenant] + 1 < num_running[victim.tenant]

    def admits(self, tenant: TenantQueue, queue: QueueStats) -> bool:
        if not queue.is_full:
            return True
        num_tenants = queue.num_tenants_waiting + (1 if tenant.num_waiting == 0 else 0)
        under = True
        if queue.max_waiting_requests is not None:
            under = tenant.num_waiting < queue.max_waiting_requests / num_tenants
        if queue.max_waiting_tokens is not None:
            under = under and tenant.num_waiting_tokens < queue.max_waiting_tokens / num_tenants
        return under
