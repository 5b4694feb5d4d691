"""Each built-in policy's orders and answers, on hand-built requests (no scheduler)."""

import pytest

from pagedserve.services.scheduler.policies.fair import FairPolicy
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.policies.priority import PriorityPolicy
from pagedserve.services.scheduler.policies.sjf import SJFPolicy, expected_work
from pagedserve.services.scheduler.policy import PolicyError, QueueStats, TenantQueue
from tests.scheduler.fakes import make_request


def _request(request_id: str, seq: int, priority: int = 0, tenant: str | None = None, num_prompt_tokens: int = 8,
             max_tokens: int = 4, arrival_time: float | None = None):
    request = make_request(request_id, num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
                           arrival_time=float(seq) if arrival_time is None else arrival_time)
    request.arrival_seq, request.priority, request.tenant = seq, priority, tenant
    return request


def _ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_fcfs_orders_by_arrival_and_never_displaces():
    a, b, c = _request("a", 2), _request("b", 0), _request("c", 1)
    policy = FCFSPolicy()
    assert _ids(policy.order_waiting([a, b, c], [])) == ["b", "c", "a"]
    assert _ids(policy.order_running([a, b, c])) == ["b", "c", "a"]
    assert not policy.may_displace(b, a, [a])


def test_priority_orders_higher_first_then_arrival_and_displaces_only_strictly_lower():
    low_old, low_new = _request("low-old", 0, priority=0), _request("low-new", 3, priority=0)
    high, mid = _request("high", 2, priority=5), _request("mid", 1, priority=1)
    policy = PriorityPolicy()
    assert _ids(policy.order_waiting([low_new, mid, low_old, high], [])) == ["high", "mid", "low-old", "low-new"]
    # the tail (preempted first) is the latest arrival of the lowest priority
    assert _ids(policy.order_running([low_old, high, low_new, mid])) == ["high", "mid", "low-old", "low-new"]
    assert policy.may_displace(high, low_new, [low_new])
    assert not policy.may_displace(low_old, low_new, [low_new])  # equal priority: no ping-pong
    assert not policy.may_displace(low_new, high, [high])


def test_sjf_orders_by_expected_work_and_ages_waiting_requests():
    long = _request("long", 0, num_prompt_tokens=40, max_tokens=20)  # work 60
    short = _request("short", 1, num_prompt_tokens=4, max_tokens=4)  # work 8
    assert expected_work(long) == 60 and expected_work(short) == 8
    policy = SJFPolicy(aging=10)
    assert _ids(policy.order_waiting([long, short], [])) == ["short", "long"]
    for _ in range(5):  # long has waited 5 more steps: 60 - 50 = 10 vs a newcomer's 8
        policy.order_waiting([long], [])
    newcomer = _request("newcomer", 2, num_prompt_tokens=4, max_tokens=4)
    assert _ids(policy.order_waiting([long, newcomer], [])) == ["long", "newcomer"]
    assert _ids(policy.order_running([long, short])) == ["short", "long"]  # the longest is preempted first
    assert not policy.may_displace(short, long, [long])


def test_sjf_forgets_a_request_that_left_the_queue():
    long = _request("long", 0, num_prompt_tokens=40, max_tokens=20)
    policy = SJFPolicy(aging=10)
    for _ in range(5):
        policy.order_waiting([long], [])
    assert policy.effective_work(long) == 60 - 40
    policy.order_waiting([], [])
    policy.order_waiting([long], [])
    assert policy.effective_work(long) == 60


def test_fair_round_robins_waiting_tenants_starting_with_the_least_served():
    running = [_request("a-run1", 0, tenant="A"), _request("a-run2", 1, tenant="A")]
    waiting = [_request(f"a{i}", 10 + i, tenant="A") for i in range(3)]
    waiting += [_request("b0", 20, tenant="B"), _request("b1", 21, tenant="B"), _request("c0", 30, tenant="C")]
    # keys: a0..a2 -> 2, 3, 4; b0, b1 -> 0, 1; c0 -> 0
    assert _ids(FairPolicy().order_waiting(waiting, running)) == ["b0", "c0", "b1", "a0", "a1", "a2"]


def test_fair_preempts_first_the_latest_request_of_the_tenant_holding_most_kv():
    a0 = _request("a0", 0, tenant="A", num_prompt_tokens=30)
    a1 = _request("a1", 1, tenant="A", num_prompt_tokens=30)
    b0 = _request("b0", 2, tenant="B", num_prompt_tokens=50)
    # held KV up to each: a0 30, a1 60, b0 50
    assert _ids(FairPolicy().order_running([b0, a1, a0])) == ["a0", "b0", "a1"]


def test_fair_displaces_only_to_narrow_a_gap_of_two_or_more():
    a = [_request(f"a{i}", i, tenant="A") for i in range(3)]
    b_run, b_new = _request("b0", 5, tenant="B"), _request("b1", 6, tenant="B")
    policy = FairPolicy()
    assert policy.may_displace(b_new, a[2], a)  # B runs 0, A runs 3: 0 + 1 < 3
    assert not policy.may_displace(b_new, a[1], a[:2] + [b_run])  # B 1 + 1 < A 2 is false
    assert not policy.may_displace(a[2], b_run, a[:2] + [b_run])  # the swap back never qualifies
    assert not policy.may_displace(_request("a9", 9, tenant="A"), a[2], a)  # own tenant


def test_fair_admission_keeps_a_fair_share_of_a_full_queue_for_other_tenants():
    full = QueueStats(num_waiting=10, num_waiting_tokens=100, max_waiting_requests=10, num_tenants_waiting=1,
                      tenants={"A": TenantQueue(10, 100)})
    assert not FCFSPolicy().admits(TenantQueue(), full)
    assert FairPolicy().admits(TenantQueue(), full)  # a newcomer: share 10 / 2 = 5
    assert not FairPolicy().admits(TenantQueue(10, 100), full)  # the flooder
    assert FairPolicy().admits(TenantQueue(4, 40), QueueStats(14, 140, 10, None, 2, {}))  # share: bound 10 / 2 tenants
    assert not FairPolicy().admits(TenantQueue(5, 50), QueueStats(14, 140, 10, None, 2, {}))
    open_queue = QueueStats(num_waiting=3, num_waiting_tokens=30, max_waiting_requests=10)
    assert FCFSPolicy().admits(TenantQueue(3, 30), open_queue) and FairPolicy().admits(TenantQueue(3, 30), open_queue)


def test_options_are_checked_naming_the_option():
    assert SJFPolicy(aging=2).aging == 2.0
    with pytest.raises(PolicyError, match="'speed'"):
        SJFPolicy(speed=1)
    with pytest.raises(PolicyError, match="'aging'"):
        SJFPolicy(aging="fast")
    with pytest.raises(PolicyError, match="'aging'"):
        FCFSPolicy(aging=1)
