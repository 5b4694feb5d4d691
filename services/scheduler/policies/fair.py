"""fair: a fair share of running slots and KV blocks per tenant.

The tenant is the request's `tenant` (the api takes it from the request's `user` field or
its API key). Shares are recomputed every step from what is running, so nothing is kept:
- waiting order: round robin over tenants, the tenant with fewest running requests first:
  the i-th waiting request (by arrival) of a tenant running s requests has key s + i,
  ties by arrival. A tenant flooding the queue only lengthens its own line;
- running order (the kvstore preempts from its tail): by the KV tokens the tenant holds
  up to and including this request (its requests by arrival), so the first victim is the
  latest request of the tenant holding the most KV;
- displacement: a waiting request may displace a running one when its tenant, after the
  swap, still runs fewer requests than the victim's tenant does now minus one
  (s_candidate + 1 < s_victim): the swap narrows the gap and can never be reversed at once;
- admission: past the queue bound, a tenant below its fair share of the bound
  (bound / tenants waiting, a newcomer counted) is still admitted, so a flood that fills
  the queue cannot lock another tenant out. The queue then stays below twice its bound.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from services.scheduler.policy import QueueStats, SchedulingPolicy, TenantQueue, arrival_key
from services.scheduler.request import Request


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
