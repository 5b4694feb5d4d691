"""n > 1 in the scheduler with the real BlockManager: the prompt is prefilled once, then
forked into n children that share its blocks (copy-on-write for the partial last one)."""

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.shared.messages import ALLOC_OK, AllocResult, Fork
from tests.scheduler.fakes import FakeWorker, make_request, make_stack, run_step, run_until_done, token_at
from tests.scheduler.outcomes import finish_reasons, outputs_by_request


def _stack(num_blocks: int = 32, **scheduler_args):
    scheduler, _, _ = make_stack(num_blocks=num_blocks, block_size=4, **scheduler_args)
    return scheduler, BlockManager(num_blocks, 4, enable_prefix_caching=True, watermark=0.0), FakeWorker(4)


def test_the_prompt_is_prefilled_once_then_forked_into_n_children():
    scheduler, manager, worker = _stack()
    parent = make_request("r", num_prompt_tokens=10, max_tokens=2, n=3, seed=7)
    scheduler.add_request(parent)
    prefill = run_step(scheduler, manager, worker)
    (new,) = prefill.plan.new_requests
    assert (new.request_id, new.block_ids, new.num_computed_tokens, new.num_scheduled_tokens) == ("r", [0, 1, 2], 0, 9)
    assert prefill.result.sampled == [] and prefill.deltas == []

    fork = run_step(scheduler, manager, worker)
    children = ["r.0", "r.1", "r.2"]
    assert fork.alloc_request.forks == [Fork("r", children)]
    assert [(c.request_id, c.num_new_tokens, c.token_ids) for c in fork.alloc_request.candidates] == [
        (child, 1, [parent.prompt_token_ids[9]]) for child in children]
    assert fork.alloc_reply.results == [AllocResult("r.0", ALLOC_OK, [0, 1, 3]), AllocResult("r.1", ALLOC_OK, [0, 1, 4]),
                                        AllocResult("r.2", ALLOC_OK, [0, 1, 2])]
    assert fork.plan.block_copies == [(2, 3), (2, 4)] and fork.plan.finished_request_ids == ["r"]
    assert [(n.request_id, n.num_computed_tokens, n.num_scheduled_tokens, n.sampling.seed)
            for n in fork.plan.new_requests] == [(child, 9, 1, 7 + i) for i, child in enumerate(children)]

    records = [prefill, fork] + run_until_done(scheduler, manager, worker)
    assert outputs_by_request(records) == {c: [token_at(c, 10), token_at(c, 11)] for c in children}
    assert finish_reasons(records) == dict.fromkeys(children, "length")
    stats = scheduler.stats()
    assert (stats.num_prompt_tokens_total, stats.num_computed_prompt_tokens_total) == (10, 9 + 3)
    assert manager.num_free_blocks == 32 and worker.requests == {}
    manager.check_integrity()


def test_a_parent_starts_after_its_cached_prefix_and_leaves_the_last_prompt_token():
    scheduler, manager, worker = _stack()
    scheduler.add_request(make_request("a", num_prompt_tokens=9, max_tokens=1))
    run_until_done(scheduler, manager, worker)
    scheduler.add_request(make_request("b", num_prompt_tokens=9, max_tokens=1, n=2))  # same prompt as "a"
    admit = run_step(scheduler, manager, worker)
    # the parent computes 8 tokens; the last of those is always computed: one block is a hit
    assert admit.alloc_request.candidates[0].num_tokens == 8
    assert [(n.request_id, n.num_computed_tokens, n.num_scheduled_tokens) for n in admit.plan.new_requests] == [
        ("b", 4, 4)]
    records = run_until_done(scheduler, manager, worker)
    assert records[0].alloc_request.forks == [Fork("b", ["b.0", "b.1"])]
    assert records[0].plan.block_copies == []  # 8 = two full blocks: each child starts a block
    assert outputs_by_request(records) == {"b.0": [token_at("b.0", 9)], "b.1": [token_at("b.1", 9)]}
    manager.check_integrity()


def test_a_child_aborted_before_the_fork_is_never_forked():
    scheduler, manager, worker = _stack()
    scheduler.add_request(make_request("r", num_prompt_tokens=10, max_tokens=1, n=2))
    assert scheduler.abort_request("r.1")
    records = run_until_done(scheduler, manager, worker)
    assert records[0].deltas[0].request_id == "r.1" and records[0].deltas[0].finish_reason == "abort"
    assert records[1].alloc_request.forks == [Fork("r", ["r.0"])]
    assert finish_reasons(records) == {"r.0": "length", "r.1": "abort"}
    assert manager.num_free_blocks == 32 and not scheduler.has_requests()


def test_aborting_every_child_or_the_parent_aborts_the_group():
    for abort_ids in (["r.0", "r.1"], ["r"]):
        scheduler, manager, worker = _stack(max_num_batched_tokens=4)
        scheduler.add_request(make_request("r", num_prompt_tokens=10, max_tokens=4, n=2))
        run_step(scheduler, manager, worker)  # the parent's first prefill chunk
        for request_id in abort_ids:
            assert scheduler.abort_request(request_id)
        records = run_until_done(scheduler, manager, worker)
        assert finish_reasons(records) == {"r.0": "abort", "r.1": "abort"}
        assert outputs_by_request(records) == {"r.0": [], "r.1": []}
        assert manager.num_free_blocks == 32 and worker.requests == {}
        manager.check_integrity()


def test_a_one_token_prompt_runs_n_plain_requests():
    scheduler, manager, worker = _stack()
    scheduler.add_request(make_request("r", num_prompt_tokens=1, max_tokens=1, n=2))
    records = run_until_done(scheduler, manager, worker)
    assert [n.request_id for n in records[0].plan.new_requests] == ["r.0", "r.1"]
    assert all(not r.alloc_request.forks for r in records)
    assert finish_reasons(records) == {"r.0": "length", "r.1": "length"}


def test_children_preempted_for_want_of_blocks_resume_and_finish():
    scheduler, manager, worker = _stack(num_blocks=6)
    scheduler.add_request(make_request("r", num_prompt_tokens=10, max_tokens=6, n=3))
    records = run_until_done(scheduler, manager, worker)
    assert scheduler.stats().num_preemptions_total >= 1
    children = ["r.0", "r.1", "r.2"]
    assert outputs_by_request(records) == {c: [token_at(c, p) for p in range(10, 16)] for c in children}
    assert manager.num_free_blocks == 6 and worker.requests == {}
    manager.check_integrity()
