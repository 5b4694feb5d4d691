"""What one step schedules: budget, decode before prefill, chunks, running limit, cache hits."""

from pagedserve.shared.messages import AllocCandidate, AllocRequest, RequestDelta
from tests.scheduler.fakes import make_request, make_stack, run_step, token_at


def test_a_100_token_prompt_is_prefilled_in_chunks_32_32_32_4():
    scheduler, allocator, worker = make_stack(max_num_batched_tokens=32)
    request = make_request("a", num_prompt_tokens=100, max_tokens=2)
    scheduler.add_request(request)
    records = [run_step(scheduler, allocator, worker) for _ in range(4)]

    assert [r.scheduled_tokens() for r in records] == [{"a": 32}, {"a": 32}, {"a": 32}, {"a": 4}]
    first = records[0].plan.new_requests
    assert len(first) == 1 and first[0].token_ids == request.prompt_token_ids
    assert (first[0].num_computed_tokens, len(first[0].block_ids)) == (0, 8)
    assert [r.plan.new_requests for r in records[1:]] == [[], [], []]
    assert [c.num_computed_tokens for r in records[1:] for c in r.plan.cached_requests] == [32, 64, 96]
    assert [r.deltas for r in records] == [
        [],
        [],
        [],
        [RequestDelta("a", [token_at("a", 100)], None, 100, 1, 0)],
    ]
    assert (request.num_computed_tokens, request.num_tokens) == (100, 101)


def test_decodes_are_scheduled_before_a_new_prefill():
    scheduler, allocator, worker = make_stack(max_num_batched_tokens=32)
    scheduler.add_request(make_request("a", num_prompt_tokens=10, max_tokens=5))
    run_step(scheduler, allocator, worker)
    b = make_request("b", num_prompt_tokens=100)
    scheduler.add_request(b)
    record = run_step(scheduler, allocator, worker)

    assert record.alloc_request == AllocRequest(
        1,
        [],
        [
            # the token learnt since its admission (the decode's input), for hashing
            AllocCandidate("a", 1, 11, token_ids=[token_at("a", 10)], token_ids_start=10),
            AllocCandidate("b", 31, 100, is_waiting=True, token_ids=b.prompt_token_ids),
        ],
        num_free_seqs=7,
    )
    assert record.scheduled_tokens() == {"a": 1, "b": 31}


def test_a_running_decode_gets_its_token_before_a_more_important_running_prefill_grows():
    scheduler, allocator, worker = make_stack(max_num_batched_tokens=32)
    scheduler.add_request(make_request("late", num_prompt_tokens=4, max_tokens=9, arrival_time=1.0))
    run_step(scheduler, allocator, worker)
    # arrived earlier, so FCFS ranks it first once it runs
    scheduler.add_request(make_request("early", num_prompt_tokens=100, arrival_time=0.0))
    records = [run_step(scheduler, allocator, worker) for _ in range(2)]

    assert [r.scheduled_tokens() for r in records] == [{"late": 1, "early": 31}, {"early": 31, "late": 1}]
    assert [c.request_id for c in records[1].alloc_request.candidates] == ["early", "late"]


def test_the_running_limit_holds_back_waiting_requests():
    scheduler, allocator, worker = make_stack(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, num_prompt_tokens=4, max_tokens=3))
    records = [run_step(scheduler, allocator, worker) for _ in range(4)]

    offered = [[c.request_id for c in r.alloc_request.candidates] for r in records]
    assert offered == [["a", "b"], ["a", "b"], ["a", "b"], ["c"]]
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 0)


def test_a_request_the_pool_cannot_hold_stays_waiting_until_blocks_free_up():
    scheduler, allocator, worker = make_stack(num_blocks=10, block_size=4)
    a = make_request("a", num_prompt_tokens=30, max_tokens=2)
    b = make_request("b", num_prompt_tokens=20, max_tokens=2)
    scheduler.add_request(a)
    scheduler.add_request(b)
    records = [run_step(scheduler, allocator, worker) for _ in range(3)]

    assert [r.scheduled_tokens() for r in records] == [{"a": 30}, {"a": 1}, {"b": 20}]
    assert records[0].alloc_request.candidates[1].request_id == "b"  # offered, not admitted
    assert records[2].alloc_request.free_request_ids == ["a"]


def test_prefix_cache_hits_skip_the_cached_tokens():
    scheduler, allocator, worker = make_stack(max_num_batched_tokens=32, prefix_hits={"a": 64})
    request = make_request("a", num_prompt_tokens=100, max_tokens=1)
    scheduler.add_request(request)
    records = [run_step(scheduler, allocator, worker) for _ in range(2)]

    new = records[0].plan.new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens, len(new.block_ids)) == (64, 32, 24)
    assert records[1].scheduled_tokens() == {"a": 4}
    assert records[1].deltas == [RequestDelta("a", [token_at("a", 100)], "length", 100, 1, 64)]
    assert scheduler.stats().num_cached_tokens_total == 64


def test_a_fully_cached_prompt_still_computes_its_last_token():
    scheduler, allocator, worker = make_stack(prefix_hits={"a": 12})
    scheduler.add_request(make_request("a", num_prompt_tokens=12, max_tokens=1))
    record = run_step(scheduler, allocator, worker)

    new = record.plan.new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (11, 1)
    assert record.deltas == [RequestDelta("a", [token_at("a", 12)], "length", 12, 1, 11)]


def test_an_idle_scheduler_builds_an_empty_step():
    scheduler, allocator, worker = make_stack()
    assert not scheduler.has_requests()
    record = run_step(scheduler, allocator, worker)
    assert record.alloc_request == AllocRequest(0, [], [], num_free_seqs=8)
    assert (record.plan.num_scheduled_tokens, record.deltas) == (0, [])
