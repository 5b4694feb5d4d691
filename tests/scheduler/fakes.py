"""Test doubles for the scheduler's two neighbours, and a loop that drives all three.

CountingAllocator: a kvstore double with real block counting (no prefix hashing; prefix
hits are injected per request id). FakeWorker: keeps per-request state from the plan's
diffs exactly as a real worker must, checks them, and samples deterministic tokens that
are never EOS (ids < 1000) unless a test forces one.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.request import Request
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.shared.messages import (
    ALLOC_NOT_ADMITTED,
    ALLOC_OK,
    ALLOC_PREEMPTED,
    AllocReply,
    AllocRequest,
    AllocResult,
    RequestDelta,
    SampledToken,
    SamplingParams,
    StepPlan,
    StepResult,
)

EOS = 1000  # the fake worker's own tokens are all < 1000


def make_request(
    request_id: str,
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    arrival_time: float = 0.0,
    **sampling_fields,
) -> Request:
    prompt = [(7 * i + len(request_id)) % 1000 for i in range(num_prompt_tokens)]
    sampling = SamplingParams(max_tokens=max_tokens, **sampling_fields)
    return Request(request_id, prompt, sampling, [EOS], arrival_time)


def token_at(request_id: str, position: int) -> int:
    """The fake model's token at `position` (0-based index in prompt + output)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % 1000


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class CountingAllocator:
    """Greedy in candidate order, as alloc_step: a candidate short of blocks (a waiting one: or of a seat)
    preempts the last running candidate after it; the first refusal or dry pool stops admission."""

    def __init__(self, num_blocks: int, block_size: int, prefix_hits: dict[str, int] | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_hits = prefix_hits or {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.num_slots: dict[str, int] = {}  # tokens its table must cover

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _free(self, request_id: str) -> None:
        self.free_block_ids.extend(self.tables.pop(request_id, []))
        self.num_slots.pop(request_id, None)

    def _grow(self, request_id: str, num_slots: int) -> list[int]:
        table = self.tables.setdefault(request_id, [])
        new = [self.free_block_ids.popleft() for _ in range(blocks_for(num_slots, self.block_size) - len(table))]
        table.extend(new)
        self.num_slots[request_id] = num_slots
        return new

    def _displace(self, candidates, results: dict[str, AllocResult], index: int) -> bool:
        """Preempt the last unanswered running candidate after index; False if there is none."""
        victims = [c for c in candidates[index + 1:] if not c.is_waiting and c.request_id not in results]
        if not victims:
            return False
        self._free(victims[-1].request_id)
        results[victims[-1].request_id] = AllocResult(victims[-1].request_id, ALLOC_PREEMPTED)
        return True

    def step(self, request: AllocRequest) -> AllocReply:
        for request_id in request.free_request_ids:
            self._free(request_id)
        results: dict[str, AllocResult] = {}
        candidates = request.candidates
        seats = request.num_free_seqs if request.num_free_seqs >= 0 else len(candidates)
        admitting = True
        for index, cand in enumerate(candidates):
            rid = cand.request_id
            if rid in results:
                continue  # preempted by a more important one
            if cand.is_waiting:
                while admitting and (seats <= 0 or blocks_for(cand.num_tokens, self.block_size)
                                     > len(self.free_block_ids)):
                    admitting = self._displace(candidates, results, index)
                    seats += admitting
                if not admitting:
                    results[rid] = AllocResult(rid, ALLOC_NOT_ADMITTED)
                    continue
                seats -= 1
                cached = min(self.prefix_hits.get(rid, 0), cand.num_tokens - 1)
                slots = cached + min(cand.num_new_tokens, cand.num_tokens - cached)
                results[rid] = AllocResult(rid, ALLOC_OK, self._grow(rid, slots), cached)
                continue
            slots = self.num_slots[rid] + cand.num_new_tokens
            need = blocks_for(slots, self.block_size) - len(self.tables[rid])
            while need > len(self.free_block_ids) and rid not in results:
                admitting = False  # a dry pool admits nobody after it
                if not self._displace(candidates, results, index):
                    self._free(rid)
                    results[rid] = AllocResult(rid, ALLOC_PREEMPTED)
                else:
                    seats += 1
            if rid not in results:
                results[rid] = AllocResult(rid, ALLOC_OK, self._grow(rid, slots))
        return AllocReply(
            request.step_id,
            [results[c.request_id] for c in candidates],
            num_free_blocks=len(self.free_block_ids),
            num_blocks=self.num_blocks,
        )

    def check_integrity(self) -> None:
        held = [b for table in self.tables.values() for b in table]
        assert sorted(held + list(self.free_block_ids)) == list(range(self.num_blocks))
        for rid, table in self.tables.items():
            assert len(table) == blocks_for(self.num_slots[rid], self.block_size)


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorker:
    """Holds what a real worker holds per request and asserts the plan's diffs add up."""

    def __init__(self, block_size: int, token_fn: Callable[[str, int], int] = token_at):
        self.block_size = block_size
        self.token_fn = token_fn
        self.requests: dict[str, _WorkerRequest] = {}
        self.block_copies: list[tuple[int, int]] = []  # every copy-on-write pair it was asked for

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        self.block_copies.extend(plan.block_copies)
        scheduled: list[tuple[str, int]] = []
        for new in plan.new_requests:
            assert new.request_id not in self.requests, "a known request sent in full again"
            self.requests[new.request_id] = _WorkerRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
            scheduled.append((new.request_id, new.num_scheduled_tokens, 1))
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
            scheduled.append((cached.request_id, cached.num_scheduled_tokens, cached.num_steps))
        result = StepResult(plan.step_id)
        for request_id, num_scheduled, num_steps in scheduled:
            state = self.requests[request_id]
            assert num_scheduled >= 1 and (num_steps == 1 or num_scheduled == 1)
            for _ in range(num_steps):  # a multi-step plan runs every step (stops are the scheduler's)
                state.num_computed_tokens += num_scheduled
                assert state.num_computed_tokens <= len(state.token_ids)
                assert len(state.block_ids) * self.block_size >= state.num_computed_tokens
                if state.num_computed_tokens == len(state.token_ids):
                    token_id = self.token_fn(request_id, len(state.token_ids))
                    state.token_ids.append(token_id)
                    result.sampled.append(SampledToken(request_id, token_id))
                num_scheduled = 1
        return result


@dataclass
class StepRecord:
    alloc_request: AllocRequest
    alloc_reply: AllocReply
    plan: StepPlan
    result: StepResult
    deltas: list[RequestDelta]

    def scheduled_tokens(self) -> dict[str, int]:
        plan = self.plan
        return {r.request_id: r.num_scheduled_tokens for r in plan.new_requests + plan.cached_requests}


def run_step(scheduler: Scheduler, allocator, worker: FakeWorker) -> StepRecord:
    alloc_request = scheduler.schedule()
    alloc_reply = allocator.step(alloc_request)
    plan = scheduler.on_alloc(alloc_reply)
    result = worker.execute(plan)
    deltas = scheduler.on_result(result)
    return StepRecord(alloc_request, alloc_reply, plan, result, deltas)


@dataclass
class PlannedStep:
    alloc_request: AllocRequest
    alloc_reply: AllocReply
    plan: StepPlan


def plan_step(scheduler: Scheduler, allocator) -> PlannedStep:
    alloc_request = scheduler.schedule()
    alloc_reply = allocator.step(alloc_request)
    return PlannedStep(alloc_request, alloc_reply, scheduler.on_alloc(alloc_reply))


def run_pipelined_step(scheduler: Scheduler, allocator, worker: FakeWorker,
                       planned: deque[PlannedStep]) -> StepRecord | None:
    """One turn of the scheduler service's async loop: plan the next step if it may and
    it pays (always with nothing in flight), then read the oldest result unless planning
    another one pays first. The worker runs a plan when its result is read: it runs plans
    in order and nothing the scheduler does meanwhile reaches it before the next plan."""
    if scheduler.can_schedule() and (not planned or scheduler.has_work_ahead()):
        planned.append(plan_step(scheduler, allocator))
        if scheduler.can_schedule() and scheduler.has_work_ahead():
            return None
    if not planned:
        return None
    step = planned.popleft()
    result = worker.execute(step.plan)
    return StepRecord(step.alloc_request, step.alloc_reply, step.plan, result, scheduler.on_result(result))


def run_pipelined_until_done(scheduler: Scheduler, allocator, worker: FakeWorker, max_steps: int = 10_000,
                             planned: deque[PlannedStep] | None = None) -> list[StepRecord]:
    records: list[StepRecord] = []
    planned = deque() if planned is None else planned
    while scheduler.has_requests():
        assert len(records) < max_steps, "scheduler made no progress"
        record = run_pipelined_step(scheduler, allocator, worker, planned)
        if record is not None:
            records.append(record)
    assert not planned
    return records


def run_until_done(scheduler: Scheduler, allocator, worker: FakeWorker, max_steps: int = 10_000) -> list[StepRecord]:
    records = []
    while scheduler.has_requests():
        assert len(records) < max_steps, "scheduler made no progress"
        records.append(run_step(scheduler, allocator, worker))
    return records


def make_stack(
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 1024,
    num_blocks: int = 256,
    block_size: int = 4,
    prefix_hits: dict[str, int] | None = None,
    token_fn: Callable[[str, int], int] = token_at,
    max_steps_in_flight: int = 1,
    stream_interval: int = 1,
    num_scheduler_steps: int = 1,  # a plan per token: the tests count steps; multi-step has its own
) -> tuple[Scheduler, CountingAllocator, FakeWorker]:
    scheduler = Scheduler(FCFSPolicy(), max_num_seqs, max_num_batched_tokens, max_model_len,
                          max_steps_in_flight=max_steps_in_flight, stream_interval=stream_interval,
                          num_scheduler_steps=num_scheduler_steps)
    allocator = CountingAllocator(num_blocks, block_size, prefix_hits)
    return scheduler, allocator, FakeWorker(block_size, token_fn)
