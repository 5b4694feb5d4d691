"""The api's admission gate on hand-made scheduler stats (no Redis): per-request limits
answer 400 naming the limit; a closed queue answers 429 with Retry-After; the policy's
per-tenant answers are honoured; this api's own burst counts against the bound."""

import pytest

from pagedserve.services.api.admission import AdmissionGate, RequestLimits, check_limits
from pagedserve.services.api.protocol import ApiError
from pagedserve.services.scheduler.admission import admission_table, queue_stats
from pagedserve.services.scheduler.policies.fair import FairPolicy
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from tests.scheduler.fakes import make_request


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _stats(policy, waiting_tenants, max_waiting_requests=4, max_waiting_tokens=None, finished=0):
    waiting = []
    for i, tenant in enumerate(waiting_tenants):
        request = make_request(f"r{i}", num_prompt_tokens=8, max_tokens=4)
        request.tenant = tenant
        waiting.append(request)
    table = admission_table(policy, queue_stats(waiting, max_waiting_requests, max_waiting_tokens))
    return {"admission": table, "num_finished_total": finished}


def test_per_request_limits_name_the_limit():
    limits = RequestLimits(max_prompt_tokens=10, max_output_tokens=5)
    check_limits(limits, 10, 5, "prompt")
    with pytest.raises(ApiError) as e:
        check_limits(limits, 11, 5, "messages")
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages", "prompt_too_long")
    assert "max_prompt_tokens=10" in e.value.message
    with pytest.raises(ApiError) as e:
        check_limits(limits, 3, 6, "prompt")
    assert e.value.status == 400 and e.value.param == "max_tokens" and "max_output_tokens=5" in e.value.message
    check_limits(RequestLimits(), 10**6, 10**6, "prompt")  # no limits set


def test_without_a_table_everything_is_admitted():
    gate = AdmissionGate()
    for _ in range(100):
        gate.check("a")


def test_a_full_queue_answers_429_with_retry_after():
    gate = AdmissionGate()
    gate.update(_stats(FCFSPolicy(), ["a"] * 4))
    with pytest.raises(ApiError) as e:
        gate.check("b")
    assert e.value.status == 429 and e.value.code == "queue_full"
    assert e.value.headers == {"Retry-After": "1"}


def test_retry_after_follows_the_recent_finish_rate():
    clock = Clock()
    gate = AdmissionGate(clock=clock)
    gate.update(_stats(FCFSPolicy(), ["a"] * 8, max_waiting_requests=4, finished=0))
    for _ in range(20):  # one request finishes every 2 s
        clock.now += 2.0
        gate.update(_stats(FCFSPolicy(), ["a"] * 8, max_waiting_requests=4, finished=int((clock.now - 100) / 2)))
    with pytest.raises(ApiError) as e:
        gate.check("a")
    # 8 waiting, bound 4: 5 must finish at ~0.5/s (smoothed, not yet fully converged)
    assert 10 <= int(e.value.headers["Retry-After"]) <= 13


def test_fair_keeps_the_queue_open_to_a_tenant_below_its_share():
    gate = AdmissionGate()
    gate.update(_stats(FairPolicy(), ["a"] * 4))
    gate.check("b")  # a newcomer: share 4 / 2
    gate.check(None)
    with pytest.raises(ApiError):
        gate.check("a")


def test_this_apis_own_burst_counts_against_the_bound_for_the_bursting_tenant():
    gate = AdmissionGate()
    gate.update(_stats(FCFSPolicy(), ["a"] * 2))  # 2 of 4 waiting
    gate.check("a")
    gate.check("a")
    with pytest.raises(ApiError):
        gate.check("a")  # 2 waiting + 2 let in since the table
    gate.check("b")  # another tenant is not locked out by a's burst before the policy saw it
    gate.update(_stats(FCFSPolicy(), ["a"] * 3))
    gate.check("a")
