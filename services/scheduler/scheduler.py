"""Scheduler: per step schedule() -> kvstore, on_alloc() -> worker, on_result() -> api deltas.

Invariants: a live request is in one of waiting/running (held fork children aside); a waiting one holds
no blocks; a finished id goes once to kvstore frees and worker drops; every ALLOC_OK grant is planned.
With max_steps_in_flight=2 step N+1 is planned while N runs; a request stopping at N wastes a token in N+1.
"""

from __future__ import annotations

import itertools
from collections import deque

from pagedserve.services.scheduler.admission import admission_table, queue_stats
from pagedserve.services.scheduler.fork import ForkGroups
from pagedserve.services.scheduler.grammar_gate import GrammarGate
from pagedserve.services.scheduler.multi_step import PlanLength, plan_steps
from pagedserve.services.scheduler.policy import SchedulingPolicy, displacement_reach
from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.services.scheduler.request_messages import (
    cached_request_data,
    new_request_data,
    request_delta,
    stream_delta,
)
from pagedserve.services.scheduler.speculation import Speculator
from pagedserve.services.scheduler.stats import SchedulerCounters, SchedulerStats
from pagedserve.services.scheduler.step import CandidateStep, InFlightStep, build_candidates, plan_tokens
from pagedserve.shared.messages import (
    ALLOC_OK,
    ALLOC_PREEMPTED,
    AllocReply,
    AllocRequest,
    RequestDelta,
    SampledToken,
    StepPlan,
    StepResult,
)
from pagedserve.shared.scheduler_config import SchedulerConfig
from pagedserve.shared.speculative_config import SpeculativeConfig

_GONE = frozenset(status for status in RequestStatus if status.is_finished) | {RequestStatus.FORKED}


class Scheduler:
    def __init__(
        self,
        policy: SchedulingPolicy,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
        max_model_len: int = 8192,
        max_waiting_requests: int | None = None,
        max_waiting_tokens: int | None = None,
        max_steps_in_flight: int = 1,
        stream_interval: int = SchedulerConfig.stream_interval,
        long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold,
        speculative_config: SpeculativeConfig | None = None,
        num_scheduler_steps: int = SchedulerConfig.num_scheduler_steps,
    ) -> None:
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,  # the validation
                        long_prefill_token_threshold=long_prefill_token_threshold, stream_interval=stream_interval,
                        num_scheduler_steps=num_scheduler_steps,
                        max_waiting_requests=max_waiting_requests, max_waiting_tokens=max_waiting_tokens)
        if max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if max_steps_in_flight not in (1, 2):
            raise ValueError("max_steps_in_flight must be 1 (synchronous) or 2 (async scheduling)")
        self.max_steps_in_flight = max_steps_in_flight
        self.stream_interval = stream_interval
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.plan_length = PlanLength(num_scheduler_steps)
        self.max_model_len = max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._arrival_seq = itertools.count()
        self._next_step_id = 0
        self._free_request_ids: list[str] = []
        self._tier_written: list[bytes] = []
        self._tier_filled: list[tuple[str, int, bytes]] = []
        self._stores_unflushed = False  # the last plan's tier writes wait for a later step's result to name them
        self._worker_finished_ids: list[str] = []
        self._abort_deltas: list[RequestDelta] = []
        self._aborts_after_alloc: list[str] = []
        self._pending: CandidateStep | None = None  # between schedule() and on_alloc()
        self._in_flight: deque[InFlightStep] = deque()  # oldest first
        self._counters = SchedulerCounters()
        self.block_size = 0  # its pool's, from the worker's hello (workers.py); 0 until then
        self._forks = ForkGroups()
        self._speculator = Speculator(speculative_config)
        self._speculating = speculative_config is not None
        self.grammars = GrammarGate()  # structured-output requests wait for their worker's compile

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.check_fresh(self.max_model_len)
        request.arrival_seq = next(self._arrival_seq)
        if request.sampling.guided is not None:
            self.grammars.want(request.sampling.guided)
        children = self._forks.make_children(request) if request.is_fork_parent else []
        if any(child.request_id in self._requests for child in children):
            self._forks.drop(request.request_id)
            raise ValueError(f"request {request.request_id!r}: a child id is already in use")
        self._counters.num_prompt_tokens_total += request.num_prompt_tokens
        if children and request.num_prompt_tokens == 1:
            self._forks.drop(request.request_id)
            for child in children:
                self._requests[child.request_id] = child
                self._waiting.append(child)
            return
        self._requests[request.request_id] = request
        self._waiting.append(request)
        for child in children:
            self._requests[child.request_id] = child  # held: abortable, not queued

    def abort_request(self, request_id: str) -> bool:
        """Finish a live request with "abort" (a pending candidate: after on_alloc); False if not live."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        parent_id = self._forks.parent_of(request_id)
        if parent_id is not None:
            self._finish_held(request)
            if self._forks.release_child(request):
                self.abort_request(parent_id)
            return True
        if self._pending is not None and any(r is request for r, _ in self._pending.candidates):
            self._aborts_after_alloc.append(request_id)
            return True
        (self._running if request.status is RequestStatus.RUNNING else self._waiting).remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        if request.is_fork_parent:  # nobody listens to a parent: its children get the deltas
            for child in self._forks.drop(request_id):
                self._finish_held(child)
        else:
            self._abort_deltas.append(request_delta(request, []))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_finished_requests(self) -> bool:
        return bool(self._free_request_ids or self._worker_finished_ids or self._abort_deltas or self._tier_written
                    or self._tier_filled or self._stores_unflushed)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests() or bool(self._in_flight)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def pending_step(self) -> CandidateStep | None:
        return self._pending

    def can_schedule(self) -> bool:
        return self._pending is None and len(self._in_flight) < self.max_steps_in_flight

    def has_work_ahead(self) -> bool:
        """A step scheduled now would compute something (frees and aborts alone can wait)."""
        return (any(r.num_tokens_wanted(self.max_model_len) > 0
                    and not (self._speculating and self._speculator.holds(r, self.max_model_len)) for r in self._running)
                or any(not r.num_pending_tokens for r in self._waiting))

    def live_requests(self) -> list[Request]:
        return list(self._requests.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> SchedulerStats:
        return self._counters.snapshot(len(self._running), len(self._waiting))

    def spec_decode_totals(self) -> dict[str, int]:
        return self._speculator.counters.totals()

    def admission_table(self) -> dict:
        queue = queue_stats(list(self._waiting), self.max_waiting_requests, self.max_waiting_tokens)
        return admission_table(self.policy, queue)

    def set_policy(self, policy: SchedulingPolicy) -> None:
        if self._pending is not None:
            raise RuntimeError("the policy can only change between steps")
        self.policy = policy

    def schedule(self) -> AllocRequest:
        if not self.can_schedule():
            raise RuntimeError("schedule() called while a step awaits its alloc reply or too many are in flight")
        step_id = self._next_step_id
        self._next_step_id += 1
        running = self.policy.order_running(self._running)
        waiting = [r for r in self.policy.order_waiting(list(self._waiting), list(self._running))
                   if (r.sampling.guided is None or not self.grammars.holds(r.sampling.guided)) and not r.num_pending_tokens]
        num_free_seqs = max(0, self.max_num_seqs - len(self._running))
        self._pending = build_candidates(
            step_id,
            running=running,
            waiting=waiting,
            num_free_seqs=num_free_seqs,
            token_budget=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            reach=displacement_reach(self.policy, waiting, running, num_free_seqs),
        )
        if self._speculating:
            self._speculator.plan(self._pending, self.max_num_batched_tokens, self.max_model_len)
        if self._speculator.drafting_off():
            plan_steps(self._pending, self.plan_length.steps(), self.max_model_len, self.max_num_batched_tokens)
        free_request_ids, self._free_request_ids = self._free_request_ids, []
        written, self._tier_written, self._stores_unflushed = self._tier_written, [], False
        filled, self._tier_filled = self._tier_filled, []
        return AllocRequest(step_id, free_request_ids, [c for _, c in self._pending.candidates],
                            forks=self._forks.take_forks() if self._forks.forks else [], tier_written=written, tier_filled=filled,
                            num_free_seqs=num_free_seqs)

    def on_alloc(self, reply: AllocReply) -> StepPlan:
        pending = self._pending
        if pending is None or reply.step_id != pending.step_id:
            raise RuntimeError(f"unexpected alloc reply for step {reply.step_id}")
        results = {result.request_id: result for result in reply.results}
        if set(results) != {c.request_id for _, c in pending.candidates}:
            raise ValueError("alloc reply does not answer exactly the candidates")
        self._pending = None
        plan = StepPlan(pending.step_id, block_copies=list(reply.block_copies), tier_stores=list(reply.tier_stores),
                        tier_fills=list(reply.tier_fills), stores_lag=self.max_steps_in_flight - 1,
                        compile_grammars=self.grammars.take_asks() if self.grammars.to_ask else [])
        in_flight = InFlightStep(pending.step_id)
        self._stores_unflushed = bool(plan.tier_stores) and plan.stores_lag > 0
        admitted: list[Request] = []
        preempted: list[Request] = []
        for request, candidate in pending.candidates:
            result = results[candidate.request_id]
            if result.status == ALLOC_OK and candidate.is_waiting:
                resumed = request.status is RequestStatus.PREEMPTED
                request.admit(result.num_cached_tokens)
                if resumed:
                    self._counters.count_resume(request.num_tokens - request.num_computed_tokens, self.block_size)
                self._counters.num_cached_tokens_total += request.num_computed_tokens
                num_scheduled = min(candidate.num_new_tokens,
                                    request.num_tokens_to_compute - request.num_computed_tokens)
                admitted.append(request)
                plan.new_requests.append(new_request_data(request, result.new_block_ids, num_scheduled,
                                                          result.tier_loads))
            elif result.status == ALLOC_OK and request.is_fresh_fork:
                num_scheduled = candidate.num_new_tokens
                request.is_fresh_fork = False
                plan.new_requests.append(new_request_data(request, result.new_block_ids, num_scheduled))
            elif result.status == ALLOC_OK:
                num_steps = pending.num_steps.get(request.request_id, 1)
                num_scheduled = 1 if num_steps > 1 else pending.num_scheduled.get(request.request_id,
                                                                                   candidate.num_new_tokens)
                drafts = pending.drafts.get(request.request_id, [])
                plan.cached_requests.append(cached_request_data(request, result.new_block_ids, num_scheduled, drafts,
                                                                num_steps))
                in_flight.scheduled.append(plan_tokens(request, num_scheduled, self._counters, drafts, num_steps))
                continue
            elif result.status == ALLOC_PREEMPTED and not candidate.is_waiting:
                preempted.append(request)
                continue
            else:
                continue  # not admitted: it keeps its place
            in_flight.scheduled.append(plan_tokens(request, num_scheduled, self._counters))
        if admitted:
            self._waiting = deque(r for r in self._waiting if r.status is not RequestStatus.RUNNING)
        self._preempt(preempted)
        self._running.extend(admitted)
        plan.finished_request_ids, self._worker_finished_ids = self._worker_finished_ids, []
        self._in_flight.append(in_flight)
        self._apply_aborts_after_alloc()
        return plan

    def on_result(self, result: StepResult) -> list[RequestDelta]:
        if not self._in_flight or result.step_id != self._in_flight[0].step_id:
            raise RuntimeError(f"unexpected step result for step {result.step_id}")
        sampled = self._in_flight[0].sampled_tokens(result)
        accepted = self._in_flight[0].accepted_drafts(result)
        self._counters.count_tier(result)
        self._tier_written += result.tier_written
        self._tier_filled += result.tier_filled
        in_flight = self._in_flight.popleft()
        if self._speculating:
            steps = max((e.num_steps for e in in_flight.scheduled), default=1)
            self._speculator.observe_step(sum(e.num_scheduled for e in in_flight.scheduled), result.step_seconds / steps)
        self.plan_length.observe(in_flight, result.step_seconds)
        if result.compiled_grammars:
            self.grammars.compiled(result.compiled_grammars)
        deltas, self._abort_deltas = self._abort_deltas, []
        finished: list[Request] = []
        for entry in in_flight.scheduled:
            request = entry.request
            if request.status in _GONE:
                continue  # aborted or stopped while the step ran: its token is dropped
            if not entry.samples:
                if entry.completes and request.status is RequestStatus.RUNNING and self._forks.is_ready(request):
                    self._fork(request)
                continue
            tokens = sampled[request.request_id]
            if entry.draft_token_ids:
                tokens[:0] = self._speculator.verdict(request, entry.draft_token_ids,
                                                      accepted.get(request.request_id, []))
            request.num_pending_tokens -= entry.num_steps
            finished_status = self._append_tokens(request, tokens)
            if finished_status is None and len(tokens) < entry.num_steps:
                raise ValueError(f"step result ends {request.request_id!r} after {len(tokens)} of its "
                                 f"{entry.num_steps} steps without a stop")
            if finished_status is not None:
                finished.append(request)
            delta = stream_delta(request, self.stream_interval, finished_status is not None)
            if delta is not None:
                deltas.append(delta)
        if finished:
            self._running = [r for r in self._running if not r.is_finished]
            if any(r.is_finished for r in self._waiting):
                self._waiting = deque(r for r in self._waiting if not r.is_finished)
        return deltas

    def _append_tokens(self, request: Request, tokens: list[SampledToken]) -> RequestStatus | None:
        """Append tokens to the output up to the first that stops it (the rest are dropped)."""
        for token in tokens:
            request.output_token_ids.append(token.token_id)
            self._counters.num_generation_tokens_total += 1
            if request.sampling.logprobs is not None:
                request.unstreamed_logprobs.append(token)
            finished_status = request.stop_status(self.max_model_len)
            if finished_status is not None:
                self._finish(request, finished_status)
                return finished_status
        return None

    def start_step_ids_at(self, step_id: int) -> None:
        """Number steps from step_id (a wall clock, so a dead predecessor's replies never match)."""
        if self._pending is not None or self._in_flight:
            raise RuntimeError("step ids can only change between steps")
        self._next_step_id = step_id

    def preempt_all(self) -> list[Request]:
        """Abandon open steps, preempt all running requests and return them, most important first."""
        self._pending = None
        self._in_flight.clear()
        for request in self._requests.values():
            request.num_pending_tokens = 0
        self._forks.forget_forks()  # the kvstore is reset: no parent table is left to split
        self.grammars.worker_lost([r.sampling.guided for r in self._requests.values()])
        moved = self.policy.order_running(self._running)
        moved += [r for r in self._running if r not in moved]
        self._preempt(moved)
        self._apply_aborts_after_alloc()
        return moved

    def _preempt(self, preempted: list[Request]) -> None:
        """RUNNING -> PREEMPTED, to the front of waiting."""
        if not preempted:
            return
        for request in preempted:
            request.preempt()
            self._worker_finished_ids.append(request.request_id)
        self._counters.num_preemptions_total += len(preempted)
        self._running = [r for r in self._running if r.status is RequestStatus.RUNNING]
        self._waiting.extendleft(reversed(preempted))

    def _fork(self, parent: Request) -> None:
        children = self._forks.fork(parent)
        index = self._running.index(parent)
        self._running[index:index + 1] = children
        parent.status = RequestStatus.FORKED
        del self._requests[parent.request_id]
        self._worker_finished_ids.append(parent.request_id)

    def _finish_held(self, child: Request) -> None:
        child.status = RequestStatus.FINISHED_ABORTED
        del self._requests[child.request_id]
        self._abort_deltas.append(request_delta(child, []))
        self._counters.num_finished_total += 1

    def _apply_aborts_after_alloc(self) -> None:
        aborts, self._aborts_after_alloc = self._aborts_after_alloc, []
        for request_id in aborts:
            self.abort_request(request_id)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Caller removes it from its queue; this queues its id for kvstore and worker."""
        request.status = status
        if self._speculating:
            self._speculator.finished(request)
        del self._requests[request.request_id]
        self._free_request_ids.append(request.request_id)
        self._worker_finished_ids.append(request.request_id)
        self._counters.num_finished_total += 1
