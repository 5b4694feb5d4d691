import gc
import weakref

import pytest

from pagedserve.services.scheduler.request import RequestStatus
from tests.scheduler.fakes import EOS, make_request


def test_counters_and_token_views():
    request = make_request("r", num_prompt_tokens=3)
    request.output_token_ids += [5, 6]
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (3, 2, 5)
    assert request.all_token_ids == request.prompt_token_ids + [5, 6]
    request.all_token_ids.append(9)  # a copy: the request is unchanged
    assert request.num_tokens == 5


def test_a_fresh_request_waits_with_nothing_computed():
    request = make_request("r")
    assert request.status is RequestStatus.WAITING
    assert (request.num_computed_tokens, request.num_cached_tokens, request.num_preemptions) == (0, 0, 0)
    assert not request.is_finished and request.finish_reason is None


@pytest.mark.parametrize(
    "status, reason",
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
    ],
)
def test_finish_reason_follows_status(status, reason):
    request = make_request("r")
    request.status = status
    assert request.finish_reason == reason
    assert request.is_finished == (reason is not None)


@pytest.mark.parametrize(
    "last_token, sampling, num_output, expected",
    [
        (EOS, {}, 1, RequestStatus.FINISHED_STOPPED),
        (EOS, {"ignore_eos": True}, 1, None),
        (EOS, {"ignore_eos": True}, 4, RequestStatus.FINISHED_LENGTH),
        (42, {"stop_token_ids": [42]}, 1, RequestStatus.FINISHED_STOPPED),
        (42, {"stop_token_ids": [42], "ignore_eos": True}, 1, RequestStatus.FINISHED_STOPPED),
        (EOS, {}, 4, RequestStatus.FINISHED_STOPPED),  # a stop wins over the length limit
        (7, {}, 3, None),
        (7, {}, 4, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_stop_status_after_the_last_sampled_token(last_token, sampling, num_output, expected):
    request = make_request("r", num_prompt_tokens=2, max_tokens=4, **sampling)
    request.output_token_ids += [7] * (num_output - 1) + [last_token]
    assert request.stop_status(max_model_len=100) == expected


def test_stop_status_at_max_model_len():
    request = make_request("r", num_prompt_tokens=8, max_tokens=100)
    request.output_token_ids += [7, 7]
    assert request.stop_status(max_model_len=11) is None
    assert request.stop_status(max_model_len=10) is RequestStatus.FINISHED_LENGTH


def test_no_stop_before_any_output():
    assert make_request("r").stop_status(max_model_len=4) is None


def test_a_request_is_freed_without_the_cycle_collector():
    gc.disable()
    try:
        request = make_request("r")
        request.output_token_ids.append(1)
        ref = weakref.ref(request)
        del request
        assert ref() is None
    finally:
        gc.enable()


def test_admit_starts_after_the_prefix_hit_and_keeps_the_first_hit():
    request = make_request("r", num_prompt_tokens=10)
    request.admit(num_cached_tokens=8)
    assert (request.status, request.num_computed_tokens, request.num_cached_tokens) == (RequestStatus.RUNNING, 8, 8)
    request.preempt()
    assert (request.status, request.num_computed_tokens, request.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    request.admit(num_cached_tokens=4)  # a resume: the first admission's hit stays reported
    assert (request.num_computed_tokens, request.num_cached_tokens) == (4, 8)


def test_admit_leaves_the_last_token_to_compute_even_on_a_full_hit():
    request = make_request("r", num_prompt_tokens=8)
    request.admit(num_cached_tokens=8)
    assert (request.num_computed_tokens, request.num_cached_tokens) == (7, 7)
