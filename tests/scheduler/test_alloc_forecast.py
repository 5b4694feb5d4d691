"""A forecast step's reply, checked against the real kvstore BlockManager's at every step it is made."""

from collections import deque

import pytest
from hypothesis import HealthCheck, settings

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.kvstore.tier_index import TierIndex
from pagedserve.services.kvstore.tier_link import TierLink
from pagedserve.services.scheduler.alloc_forecast import differs, forecast_reply
from pagedserve.shared.messages import AllocRequest
from tests.scheduler.fakes import FakeWorker, make_request, make_stack, run_pipelined_step, run_until_done
from tests.scheduler.scheduler_machine import BLOCK_SIZE, AsyncSchedulerMachine, SchedulerMachine


class ForecastChecker:
    """The BlockManager, asserting before each step that a forecast it allows equals its reply."""

    def __init__(self, manager: BlockManager, scheduler) -> None:
        self.manager, self.scheduler = manager, scheduler
        self.num_forecast = self.num_steps = 0

    def step(self, alloc: AllocRequest):
        forecast = forecast_reply(alloc, self.scheduler.pending_step, self.manager.block_size)
        reply = self.manager.step(alloc)
        self.num_steps += 1
        if forecast is not None:
            self.num_forecast += 1
            assert differs(forecast, reply) is None, (differs(forecast, reply), alloc)
            assert not reply.tier_stores and not reply.tier_fills and not reply.block_copies
            assert reply.num_free_blocks == self.manager.num_free_blocks
        return reply

    def __getattr__(self, name):
        return getattr(self.manager, name)


class _Checked:
    def make_allocator(self, num_blocks: int):
        self.scheduler.block_size = BLOCK_SIZE
        return ForecastChecker(BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=True), self.scheduler)


class SyncForecastMachine(_Checked, SchedulerMachine):
    pass


class AsyncForecastMachine(_Checked, AsyncSchedulerMachine):
    pass


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)
TestSyncForecast = SyncForecastMachine.TestCase
TestSyncForecast.settings = MACHINE_SETTINGS
TestAsyncForecast = AsyncForecastMachine.TestCase
TestAsyncForecast.settings = MACHINE_SETTINGS


def _checked_stack(block_size: int = 16, tier: bool = False, **scheduler_args):
    scheduler, _, _ = make_stack(block_size=block_size, **scheduler_args)
    scheduler.block_size = block_size
    link = TierLink(TierIndex(1 << 20), "ns", 1) if tier else None
    checker = ForecastChecker(BlockManager(256, block_size, enable_prefix_caching=True, tier=link), scheduler)
    return scheduler, checker, FakeWorker(block_size)


@pytest.mark.parametrize("tier", [False, True])
def test_a_lone_decode_is_forecast_except_where_a_block_starts_or_fills(tier):
    scheduler, checker, worker = _checked_stack(tier=tier, max_steps_in_flight=2)
    scheduler.add_request(make_request("a", num_prompt_tokens=20, max_tokens=64, ignore_eos=True))
    scheduler.add_request(make_request("b", num_prompt_tokens=37, max_tokens=50, ignore_eos=True))
    planned: deque = deque()
    while scheduler.has_requests():
        run_pipelined_step(scheduler, checker, worker, planned)
    assert checker.num_forecast >= checker.num_steps // 2


def test_forked_sequences_are_forecast_only_after_their_copy_on_write():
    scheduler, checker, worker = _checked_stack(block_size=4)
    scheduler.add_request(make_request("p", num_prompt_tokens=6, max_tokens=12, ignore_eos=True, n=3, seed=1))
    records = run_until_done(scheduler, checker, worker)
    assert checker.num_forecast > 0
    assert not any(forecast_reply(r.alloc_request, None, 4) for r in records)


def test_nothing_is_forecast_without_a_block_size_or_with_frees():
    scheduler, checker, worker = _checked_stack(block_size=16)
    scheduler.add_request(make_request("a", num_prompt_tokens=20, max_tokens=8, ignore_eos=True))
    run_until_done(scheduler, checker, worker)
    alloc = AllocRequest(1, free_request_ids=["a"])
    assert forecast_reply(alloc, scheduler.pending_step, 16) is None
    assert forecast_reply(AllocRequest(2), None, 16) is None
