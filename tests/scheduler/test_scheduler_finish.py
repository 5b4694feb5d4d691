"""How requests end: stop conditions, aborts at every point of a step, and what is freed."""

import gc
import weakref

import pytest

from pagedserve.shared.messages import RequestDelta, StepResult
from tests.scheduler.fakes import EOS, make_request, make_stack, run_step, run_until_done, token_at
from tests.scheduler.outcomes import finish_reasons, outputs_by_request


def _eos_second(request_id: str, position: int) -> int:
    """The fake model says EOS as the second output token of an 8-token prompt."""
    return EOS if position == 9 else token_at(request_id, position)


@pytest.mark.parametrize(
    "sampling, max_model_len, expected_output, reason",
    [
        ({"max_tokens": 3}, 1024, [token_at("a", 8), EOS], "stop"),
        ({"max_tokens": 3, "ignore_eos": True}, 1024, [token_at("a", 8), EOS, token_at("a", 10)], "length"),
        ({"max_tokens": 3, "stop_token_ids": [token_at("a", 8)]}, 1024, [token_at("a", 8)], "stop"),
        ({"max_tokens": 1}, 1024, [token_at("a", 8)], "length"),
        ({"max_tokens": 100, "ignore_eos": True}, 11, [token_at("a", 8), EOS, token_at("a", 10)], "length"),
    ],
)
def test_stop_conditions(sampling, max_model_len, expected_output, reason):
    scheduler, allocator, worker = make_stack(max_model_len=max_model_len, token_fn=_eos_second)
    request = make_request("a", num_prompt_tokens=8, **sampling)
    scheduler.add_request(request)
    records = run_until_done(scheduler, allocator, worker)

    assert outputs_by_request(records) == {"a": expected_output}
    assert finish_reasons(records) == {"a": reason}
    assert request.output_token_ids == expected_output
    assert [len(r.deltas) for r in records] == [1] * len(expected_output) + [0]


def _freed_by_next_step(scheduler, allocator, worker, request_id: str, everything: bool = True):
    """Run a step: it frees `request_id` at the kvstore and the worker (and, by default, all)."""
    record = run_step(scheduler, allocator, worker)
    assert record.alloc_request.free_request_ids == [request_id]
    assert record.plan.finished_request_ids == [request_id]
    if everything:
        assert allocator.tables == {} and worker.requests == {}
    return record


def test_a_finished_request_is_freed_by_the_next_step():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a", max_tokens=1))
    first = run_step(scheduler, allocator, worker)
    assert first.deltas == [RequestDelta("a", [token_at("a", 8)], "length", 8, 1, 0)]
    assert allocator.tables == {"a": [0, 1]} and scheduler.has_requests()

    _freed_by_next_step(scheduler, allocator, worker, "a")
    assert not scheduler.has_requests()


def test_abort_a_waiting_request():
    scheduler, allocator, worker = make_stack(max_num_seqs=1)
    scheduler.add_request(make_request("a", max_tokens=5))
    scheduler.add_request(make_request("b"))
    run_step(scheduler, allocator, worker)
    assert scheduler.abort_request("b")
    assert not scheduler.abort_request("b")
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 0)

    record = _freed_by_next_step(scheduler, allocator, worker, "b", everything=False)
    assert record.deltas == [
        RequestDelta("b", [], "abort", 8, 0, 0),
        RequestDelta("a", [token_at("a", 9)], None, 8, 2, 0),
    ]


def test_abort_a_running_request_frees_its_blocks_next_step():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a", max_tokens=5))
    run_step(scheduler, allocator, worker)
    assert scheduler.abort_request("a")
    assert not scheduler.has_unfinished_requests() and scheduler.has_requests()

    record = run_step(scheduler, allocator, worker)
    assert record.alloc_request.free_request_ids == ["a"]
    assert record.alloc_request.candidates == []
    assert record.deltas == [RequestDelta("a", [], "abort", 8, 1, 0)]
    assert allocator.tables == {} and worker.requests == {}
    assert not scheduler.has_requests()


def test_abort_while_awaiting_the_alloc_reply_still_runs_what_the_kvstore_granted():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a"))
    alloc_request = scheduler.schedule()
    assert scheduler.abort_request("a")
    plan = scheduler.on_alloc(allocator.step(alloc_request))
    # granted blocks may already be listed as cached prefixes: the worker must fill them
    assert [(n.request_id, n.block_ids) for n in plan.new_requests] == [("a", [0, 1])]
    assert not scheduler.abort_request("a")
    assert scheduler.on_result(worker.execute(plan)) == [RequestDelta("a", [], "abort", 8, 0, 0)]

    _freed_by_next_step(scheduler, allocator, worker, "a")


def test_abort_while_the_step_runs_drops_its_token():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a"))
    plan = scheduler.on_alloc(allocator.step(scheduler.schedule()))
    scheduler.abort_request("a")
    result = worker.execute(plan)
    assert [t.request_id for t in result.sampled] == ["a"]
    assert scheduler.on_result(result) == [RequestDelta("a", [], "abort", 8, 0, 0)]

    _freed_by_next_step(scheduler, allocator, worker, "a")


def test_unknown_ids_cannot_be_aborted():
    scheduler, _, _ = make_stack()
    assert not scheduler.abort_request("nobody")
    assert not scheduler.has_requests()


def test_finished_requests_are_not_kept_alive():
    scheduler, allocator, worker = make_stack()
    refs = []
    gc.disable()
    try:
        for request_id in ("done", "aborted"):
            request = make_request(request_id, max_tokens=3)
            refs.append(weakref.ref(request))
            scheduler.add_request(request)
        del request
        run_step(scheduler, allocator, worker)
        scheduler.abort_request("aborted")
        run_until_done(scheduler, allocator, worker)
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_stats_count_what_happened():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a", num_prompt_tokens=8, max_tokens=3))
    scheduler.add_request(make_request("b", num_prompt_tokens=5, max_tokens=3))
    run_step(scheduler, allocator, worker)
    scheduler.abort_request("b")
    run_until_done(scheduler, allocator, worker)

    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions_total) == (0, 0, 0)
    assert (stats.num_prompt_tokens_total, stats.num_generation_tokens_total) == (13, 4)
    assert (stats.num_cached_tokens_total, stats.num_finished_total) == (0, 2)


def test_a_result_without_the_token_a_finished_prefill_owes_is_refused():
    scheduler, allocator, worker = make_stack()
    scheduler.add_request(make_request("a"))
    plan = scheduler.on_alloc(allocator.step(scheduler.schedule()))
    with pytest.raises(ValueError, match="disagree"):
        scheduler.on_result(StepResult(plan.step_id, []))
