"""The scheduler driven with the real kvstore BlockManager instead of the counting double."""

import pytest
from hypothesis import HealthCheck, settings

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.shared.block_hash import BlockHashes, hash_full_blocks, root_hash
from pagedserve.shared.messages import RequestDelta
from tests.scheduler.fakes import FakeWorker, make_request, make_stack, run_step, run_until_done, token_at
from tests.scheduler.outcomes import finish_reasons, outputs_by_request
from tests.scheduler.scheduler_machine import BLOCK_SIZE, AsyncSchedulerMachine, SchedulerMachine

MACHINE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    report_multiple_bugs=False,
)


class BlockManagerMachine(SchedulerMachine):
    def make_allocator(self, num_blocks: int):
        return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)


class PrefixCachingBlockManagerMachine(SchedulerMachine):
    """make_request gives ids of equal length equal prompts: plenty of prefix hits."""

    def make_allocator(self, num_blocks: int):
        return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)


class AsyncPrefixCachingBlockManagerMachine(AsyncSchedulerMachine):
    """Async scheduling with the real kvstore: its tokens lag the slots by a step."""

    def make_allocator(self, num_blocks: int):
        return BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)


TestSchedulerWithBlockManager = BlockManagerMachine.TestCase
TestSchedulerWithBlockManager.settings = MACHINE_SETTINGS
TestSchedulerWithPrefixCaching = PrefixCachingBlockManagerMachine.TestCase
TestSchedulerWithPrefixCaching.settings = MACHINE_SETTINGS
TestAsyncSchedulerWithPrefixCaching = AsyncPrefixCachingBlockManagerMachine.TestCase
TestAsyncSchedulerWithPrefixCaching.settings = MACHINE_SETTINGS


def _stack(num_blocks: int, block_size: int, prefix: bool, **scheduler_args):
    scheduler, _, _ = make_stack(num_blocks=num_blocks, block_size=block_size, **scheduler_args)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=0.0)
    return scheduler, manager, FakeWorker(block_size)


def test_a_repeated_prompt_starts_after_its_cached_full_blocks():
    scheduler, manager, worker = _stack(num_blocks=64, block_size=16, prefix=True)
    scheduler.add_request(make_request("a", num_prompt_tokens=100, max_tokens=1))
    run_until_done(scheduler, manager, worker)
    b = make_request("b", num_prompt_tokens=100, max_tokens=1)  # same prompt as "a"
    scheduler.add_request(b)
    records = run_until_done(scheduler, manager, worker)

    new = records[0].plan.new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens, len(new.block_ids)) == (96, 4, 7)
    assert records[0].deltas == [RequestDelta("b", [token_at("b", 100)], "length", 100, 1, 96)]
    assert manager.num_free_blocks == 64
    manager.check_integrity()


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_with_the_block_manager_changes_no_token(prefix):
    def requests():
        # each ends at 20 tokens = 5 blocks of 4; a 7-block pool cannot hold both
        return [make_request(r, num_prompt_tokens=8, max_tokens=12, arrival_time=t) for r, t in (("a", 0), ("b", 1))]

    (scheduler, manager, worker, records), (reference_scheduler, _, _, reference) = _small_and_big_pool(
        requests, 7, 4, prefix)
    assert scheduler.stats().num_preemptions_total >= 1
    assert reference_scheduler.stats().num_preemptions_total == 0
    assert outputs_by_request(records) == outputs_by_request(reference)
    assert finish_reasons(records) == {"a": "length", "b": "length"}
    assert manager.num_free_blocks == 7 and worker.requests == {}


def _small_and_big_pool(requests, num_blocks: int, block_size: int, prefix: bool):
    """(scheduler, manager, worker, step records) with num_blocks (integrity checked each step),
    then the same with a 64-block pool, each run over a fresh requests()."""
    runs = []
    for pool in (num_blocks, 64):
        scheduler, manager, worker = _stack(pool, block_size, prefix)
        for request in requests():
            scheduler.add_request(request)
        records = []
        while scheduler.has_requests():
            records.append(run_step(scheduler, manager, worker))
            manager.check_integrity()
        runs.append((scheduler, manager, worker, records))
    return runs


@pytest.mark.parametrize("prefix", [True, False])
def test_a_resumed_request_counts_what_it_recomputes(prefix):
    """Preempted with 40 + 9 tokens known: with its 3 full blocks still cached it recomputes only
    the 1 token of its partial block; without, all 49 (over one block)."""
    scheduler, manager, worker = _stack(num_blocks=64, block_size=16, prefix=prefix)
    scheduler.block_size = 16
    scheduler.add_request(make_request("a", num_prompt_tokens=40, max_tokens=30))
    for _ in range(10):
        run_step(scheduler, manager, worker)
    assert [r.request_id for r in scheduler.preempt_all()] == ["a"]
    run_step(scheduler, manager, worker)
    stats = scheduler.stats()
    assert (stats.num_resumed_total, stats.num_resumed_recomputed_tokens_total,
            stats.num_resumed_over_one_block_total) == ((1, 1, 0) if prefix else (1, 49, 1))
    run_until_done(scheduler, manager, worker)
    manager.check_integrity()


def _no_kvstore_hashing(monkeypatch) -> None:
    def no_hashing(*args):
        raise AssertionError("the kvstore hashed a block the scheduler had hashed")

    monkeypatch.setattr("pagedserve.services.kvstore.block_table.hash_block", no_hashing)
    monkeypatch.setattr("pagedserve.services.kvstore.block_manager.hash_full_blocks", no_hashing)


def test_fork_children_carry_the_parents_hashes_and_extend_their_own(monkeypatch):
    _no_kvstore_hashing(monkeypatch)
    scheduler, manager, worker = _stack(num_blocks=64, block_size=4, prefix=True)
    parent = make_request("p", num_prompt_tokens=10, max_tokens=9, n=2, seed=1)
    parent.block_hashes = BlockHashes(root_hash(()), 4)
    scheduler.add_request(parent)
    records = run_until_done(scheduler, manager, worker)
    outputs = outputs_by_request(records)
    assert sorted(outputs) == ["p.0", "p.1"] and all(len(tokens) == 9 for tokens in outputs.values())
    for child_id, tokens in outputs.items():  # 10 + 9 tokens: 4 full blocks, each child's own
        hashes = hash_full_blocks(parent.prompt_token_ids + tokens[:8], 4)
        assert all(manager.pool.lookup(h) is not None for h in hashes), child_id
    manager.check_integrity()


def test_hashes_computed_once_by_the_scheduler_are_the_kvstores_and_it_hashes_nothing(monkeypatch):
    """Requests carry their block hashes (as WorkerTable.place gives them): the kvstore, which
    hashes nothing, caches every full block of prompt and output under the hash it would have
    computed, a repeated prompt hits them, and preemption under a small pool changes no token."""
    _no_kvstore_hashing(monkeypatch)

    def requests():
        made = [make_request(r, num_prompt_tokens=30, max_tokens=20, arrival_time=t) for r, t in (("a", 0), ("b", 1))]
        for request in made:
            request.block_hashes = BlockHashes(root_hash(()), 4)
        return made

    # 18 blocks for 2 requests of 13: one is preempted
    (scheduler, _, _, records), reference_run = _small_and_big_pool(requests, 18, 4, True)
    reference_scheduler, reference_manager, reference_worker, reference = reference_run
    assert scheduler.stats().num_preemptions_total >= 1
    assert outputs_by_request(records) == outputs_by_request(reference)
    a = requests()[0]
    a.output_token_ids = outputs_by_request(reference)["a"]
    full_blocks = hash_full_blocks(a.all_token_ids[:49], 4)  # 30 + 20 tokens: the last one's KV is never computed
    assert all(reference_manager.pool.lookup(h) is not None for h in full_blocks)
    again = make_request("a2", num_prompt_tokens=30, max_tokens=1)
    again.prompt_token_ids = list(a.prompt_token_ids)
    again.block_hashes = BlockHashes(root_hash(()), 4)
    reference_scheduler.add_request(again)
    first = run_step(reference_scheduler, reference_manager, reference_worker)
    assert first.plan.new_requests[0].num_computed_tokens == 28  # 7 full blocks of the 30-token prompt
