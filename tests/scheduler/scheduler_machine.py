"""A hypothesis state machine: random adds, steps and aborts (at any phase of a step).

Checked after every rule: the token budget and the running limit hold, every live request
sits in one queue with sane counters, deltas replay each request's output exactly.
Checked at teardown, after stepping until nothing is left: every request finished, each
non-aborted one with exactly the tokens and reason a run without any contention gives
(so preemption and chunking change nothing), and the kvstore holds no block.

Subclasses choose the kvstore (make_allocator) to run the same machine against the real one,
or async scheduling (AsyncSchedulerMachine: up to two steps in flight, driven as the
scheduler service drives them).
"""

from __future__ import annotations

import zlib
from collections import deque

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.services.scheduler.policies.fcfs import FCFSPolicy
from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.services.scheduler.scheduler import Scheduler
from tests.scheduler.fakes import (
    EOS,
    CountingAllocator,
    FakeWorker,
    PlannedStep,
    make_request,
    run_pipelined_step,
    run_step,
    token_at,
)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48  # 12 blocks: the smallest pool below still holds any one request
MAX_STEPS_TO_DRAIN = 5_000  # observed at most ~350


def sometimes_eos(request_id: str, position: int) -> int:
    return EOS if zlib.crc32(f"eos:{request_id}:{position}".encode()) % 11 == 0 else token_at(request_id, position)


def uncontended_output(request: Request) -> tuple[list[int], str]:
    """What the request produces when it runs alone: the reference for every schedule."""
    output: list[int] = []
    while True:
        token_id = sometimes_eos(request.request_id, request.num_prompt_tokens + len(output))
        output.append(token_id)
        if token_id == EOS and not request.sampling.ignore_eos:
            return output, "stop"
        if len(output) >= request.sampling.max_tokens:
            return output, "length"
        if request.num_prompt_tokens + len(output) >= MAX_MODEL_LEN:
            return output, "length"


class SchedulerMachine(RuleBasedStateMachine):
    max_steps_in_flight = 1

    def make_allocator(self, num_blocks: int):
        return CountingAllocator(num_blocks, BLOCK_SIZE)

    @initialize(
        max_num_seqs=st.integers(1, 4),
        token_budget=st.integers(1, 48),
        num_blocks=st.integers(12, 20),
        num_scheduler_steps=st.sampled_from([1, 2, 4, 8]),
    )
    def setup(self, max_num_seqs, token_budget, num_blocks, num_scheduler_steps):
        self.scheduler = Scheduler(FCFSPolicy(), max_num_seqs, token_budget, MAX_MODEL_LEN,
                                   max_steps_in_flight=self.max_steps_in_flight, num_scheduler_steps=num_scheduler_steps)
        self.planned: deque[PlannedStep] = deque()
        self.num_blocks = num_blocks
        self.allocator = self.make_allocator(num_blocks)
        self.worker = FakeWorker(BLOCK_SIZE, sometimes_eos)
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}

    def _live_ids(self) -> list[str]:
        return sorted(rid for rid, r in self.requests.items() if not r.is_finished)

    def _take(self, deltas) -> None:
        for delta in deltas:
            assert delta.request_id not in self.finish_reasons, "delta after the finish"
            self.outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                self.finish_reasons[delta.request_id] = delta.finish_reason

    def _check_step(self, alloc_request, plan) -> None:
        budget = self.scheduler.max_num_batched_tokens
        assert sum(c.num_new_tokens for c in alloc_request.candidates) <= budget
        assert plan.num_scheduled_tokens <= budget
        assert self.scheduler.num_running <= self.scheduler.max_num_seqs
        self.allocator.check_integrity()

    @rule(
        num_prompt_tokens=st.integers(1, 40),
        max_tokens=st.integers(1, 20),
        ignore_eos=st.booleans(),
        arrival_time=st.sampled_from([0.0, 1.0, 2.0]),
    )
    def add(self, num_prompt_tokens, max_tokens, ignore_eos, arrival_time):
        request_id = f"r{len(self.requests)}"
        request = make_request(request_id, num_prompt_tokens, max_tokens, arrival_time, ignore_eos=ignore_eos)
        self.requests[request_id] = request
        self.scheduler.add_request(request)

    @rule()
    def step(self):
        record = self._run_one_step()
        if record is not None:
            self._check_step(record.alloc_request, record.plan)
            self._take(record.deltas)

    def _run_one_step(self):
        return run_step(self.scheduler, self.allocator, self.worker)

    @precondition(lambda self: any(not r.is_finished for r in self.requests.values()))
    @rule(data=st.data(), phase=st.sampled_from(["before", "after_schedule", "after_alloc"]))
    def abort(self, data, phase):
        victim = data.draw(st.sampled_from(self._live_ids()))
        if phase == "before" or not self.scheduler.can_schedule():  # async: two steps in flight
            assert self.scheduler.abort_request(victim)
            return
        self._planned_with_abort(self._plan_with_abort(victim, phase))

    def _planned_with_abort(self, step: PlannedStep) -> None:
        self._take(self.scheduler.on_result(self.worker.execute(step.plan)))

    def _plan_with_abort(self, victim: str, phase: str) -> PlannedStep:
        """Plan a step, aborting victim after schedule() or after on_alloc()."""
        alloc_request = self.scheduler.schedule()
        if phase == "after_schedule":
            self.scheduler.abort_request(victim)
        reply = self.allocator.step(alloc_request)
        plan = self.scheduler.on_alloc(reply)
        if phase == "after_alloc":
            self.scheduler.abort_request(victim)
        self._check_step(alloc_request, plan)
        return PlannedStep(alloc_request, reply, plan)

    @rule(phase=st.sampled_from(["between", "after_schedule", "after_alloc"]))
    def peers_lose_state(self, phase):
        """The kvstore and the worker restart empty; running requests recompute."""
        if phase != "between" and self.scheduler.can_schedule():
            alloc_request = self.scheduler.schedule()
            if phase == "after_alloc":
                self.scheduler.on_alloc(self.allocator.step(alloc_request))
        self.scheduler.preempt_all()
        self.planned.clear()  # async: their results are never read
        self.allocator = self.make_allocator(self.num_blocks)
        self.worker = FakeWorker(BLOCK_SIZE, sometimes_eos)

    @invariant()
    def queues_and_counters_agree(self):
        live = [r for r in self.requests.values() if not r.is_finished]
        running = [r for r in live if r.status is RequestStatus.RUNNING]
        assert self.scheduler.num_running == len(running)
        assert self.scheduler.num_waiting == len(live) - len(running)
        for request in live:
            if request.status is RequestStatus.RUNNING:  # a step in flight may sample its pending tokens
                pending = request.num_pending_tokens
                assert 0 <= request.num_computed_tokens < request.num_tokens + pending + (pending > 0)
            else:
                assert request.num_computed_tokens == 0
        for request_id, output in self.outputs.items():
            assert output == self.requests[request_id].output_token_ids
        stats = self.scheduler.stats()
        assert stats.num_finished_total == len(self.requests) - len(live)
        assert stats.num_generation_tokens_total >= sum(len(o) for o in self.outputs.values())

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        steps = 0
        while self.scheduler.has_requests():
            assert steps < MAX_STEPS_TO_DRAIN, "requests never finish"
            self.step()
            steps += 1
        for request_id, request in self.requests.items():
            assert request.is_finished
            reason = self.finish_reasons[request_id]
            assert reason == request.finish_reason
            if reason != "abort":
                assert (self.outputs.get(request_id, []), reason) == uncontended_output(request)
        self.allocator.check_integrity()
        assert self.allocator.num_free_blocks == self.allocator.num_blocks
        assert self.worker.requests == {}
        assert not self.planned


class AsyncSchedulerMachine(SchedulerMachine):
    """Up to two steps in flight; aborts and peer loss land between any two phases."""

    max_steps_in_flight = 2

    def _run_one_step(self):
        return run_pipelined_step(self.scheduler, self.allocator, self.worker, self.planned)

    def _planned_with_abort(self, step: PlannedStep) -> None:
        self.planned.append(step)  # its result is read by a later step
