from hypothesis import given
from hypothesis import strategies as st

from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.policy import SchedulingPolicy
from tests.scheduler.fakes import make_request


def _requests(arrivals: list[float]):
    requests = []
    for seq, arrival in enumerate(arrivals):
        request = make_request(f"r{seq}", arrival_time=arrival)
        request.arrival_seq = seq
        requests.append(request)
    return requests


def test_fcfs_orders_by_arrival_time_then_arrival_sequence():
    a, b, c, d = _requests([2.0, 1.0, 2.0, 0.5])
    policy = FCFSPolicy()
    assert policy.order_waiting([a, b, c, d]) == [d, b, a, c]
    assert policy.order_running([c, a, d, b]) == [d, b, a, c]
    assert policy.name == "fcfs"
    assert isinstance(policy, SchedulingPolicy)


@given(st.lists(st.sampled_from([0.0, 1.0, 2.0]), max_size=12), st.randoms())
def test_fcfs_order_is_a_permutation_and_leaves_the_input_alone(arrivals, rnd):
    requests = _requests(arrivals)
    shuffled = list(requests)
    rnd.shuffle(shuffled)
    before = list(shuffled)
    ordered = FCFSPolicy().order_waiting(shuffled)
    assert shuffled == before
    assert ordered == sorted(requests, key=lambda r: (r.arrival_time, r.arrival_seq))
