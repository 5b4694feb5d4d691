"""displacement_reach: where each waiting request stands among the running ones (the kvstore
preempts only those after a candidate), checked victim by victim as the tail would be taken."""

from pagedserve.services.scheduler.policies.fair import FairPolicy
from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.policies.priority import PriorityPolicy
from pagedserve.services.scheduler.policy import displacement_reach
from tests.scheduler.fakes import make_request


def _request(request_id, arrival, priority=0, tenant=None):
    request = make_request(request_id, arrival_time=arrival)
    request.priority, request.tenant, request.arrival_seq = priority, tenant, int(arrival)
    return request


def test_fcfs_places_every_waiting_request_after_the_running_ones_and_offers_only_free_seats():
    policy = FCFSPolicy()
    running = [_request("r0", 0), _request("r1", 1)]
    waiting = [_request("w0", 2), _request("w1", 3), _request("w2", 4)]
    assert displacement_reach(policy, waiting, running, num_free_seqs=2) == [2, 2]
    assert displacement_reach(policy, waiting, running, num_free_seqs=0) == []


def test_priority_stands_before_every_strictly_lower_one_and_equals_wait():
    policy = PriorityPolicy()
    running = [_request("r0", 0, priority=3), _request("r1", 1), _request("r2", 2)]
    waiting = [_request("high", 3, priority=5), _request("mid", 4, priority=1), _request("low", 5)]
    # high may displace all three; mid the two at 0 (tail r2 taken by high's seat, then r1); low nobody
    assert displacement_reach(policy, waiting, running, num_free_seqs=0) == [0, 1]
    assert displacement_reach(policy, waiting, running, num_free_seqs=3) == [0, 1, 3]


def test_a_later_waiting_request_never_reaches_past_an_earlier_one():
    policy = PriorityPolicy()
    running = [_request("r0", 0), _request("r1", 1)]
    waiting = [_request("w0", 2), _request("w1", 3, priority=9)]  # out of the policy's order on purpose
    assert displacement_reach(policy, waiting, running, num_free_seqs=1) == [2]


def test_fair_counts_each_taken_victim_before_the_next_check():
    policy = FairPolicy()
    running = [_request(f"a{i}", i, tenant="A") for i in range(3)]
    waiting = [_request("b0", 10, tenant="B"), _request("b1", 11, tenant="B")]
    # b0: B 0 + 1 < A 3 takes a2; with b0 counted, B 1 + 1 < A 2 fails: one victim, b1 waits
    assert displacement_reach(policy, waiting, running, num_free_seqs=0) == [2]
    # with a seat free b0 takes none; b1 then takes a2 (B 1 + 1 < A 3), standing where b0 does
    assert displacement_reach(policy, waiting, running, num_free_seqs=1) == [2, 2]
