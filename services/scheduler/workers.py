"""The scheduler's table of workers (no Redis): per live worker a lane with its own Scheduler
and step state; a worker that left has its requests moved to the survivors (handover.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.services.scheduler.admission import admission_table, queue_stats
from pagedserve.services.scheduler.alloc_forecast import MAX_DEFERRED_ALLOCS, forecast_reply, run_ends_next
from pagedserve.services.scheduler.api_routes import final_delta
from pagedserve.services.scheduler.handover import adopt, release_all
from pagedserve.services.scheduler.placement import Candidate, Router
from pagedserve.services.scheduler.request import Request, RequestStatus
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.shared.block_hash import BlockHashes, root_hash
from pagedserve.shared.messages import (
    KEY_BYTES,
    AllocReply,
    AllocRequest,
    RequestDelta,
    StepPlan,
    StepResult,
    WorkerHello,
)
from pagedserve.shared.parallel_sampling import child_request_ids

log = logging.getLogger("pagedserve.scheduler")

COUNTERS = ("num_preemptions_total", "num_prompt_tokens_total", "num_computed_prompt_tokens_total",
            "num_cached_tokens_total", "num_generation_tokens_total", "num_finished_total", "num_resumed_total",
            "num_resumed_recomputed_tokens_total", "num_tier_loaded_blocks_total", "num_tier_missed_blocks_total",
            "tier_load_seconds_total", "num_tier_stored_blocks_total", "tier_store_seconds_total",
            "tier_loaded_bytes_total", "tier_stored_bytes_total", "num_resumed_over_one_block_total")


@dataclass
class WorkerLane:
    hello: WorkerHello
    sched: Scheduler
    incarnation: str
    reset_kv: bool = True
    reset_worker: bool = True
    awaiting_alloc: int | None = None
    plans: deque[StepPlan] = field(default_factory=deque)  # sent, result not read yet; oldest first
    replies: dict[tuple[str, int], AllocReply | StepResult] = field(default_factory=dict)  # came early
    deadline: float = 0.0  # monotonic
    strikes: Counter[str] = field(default_factory=Counter)
    held_blocks: int = 0
    new_blocks: dict[str, int] = field(default_factory=dict)  # placed request id -> blocks not cached here
    deferred_allocs: list[AllocRequest] = field(default_factory=list)  # forecast steps' requests, not sent yet
    forecasts: dict[int, AllocReply] = field(default_factory=dict)  # step id -> the reply its plan assumed

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    def expects(self, kind: str, step_id: int) -> bool:
        if kind == "alloc":
            return step_id == self.awaiting_alloc
        return any(plan.step_id == step_id for plan in self.plans)

    def is_awaiting(self) -> bool:
        return self.awaiting_alloc is not None or bool(self.plans)

    def touch(self, step_timeout_s: float) -> None:
        self.deadline = time.monotonic() + step_timeout_s

    def abandon(self) -> list[Request]:
        """Abandon every open step; running requests go back to waiting. Returns them."""
        moved = self.sched.preempt_all()
        self.reset_kv = self.reset_worker = True
        self.awaiting_alloc = None
        self.plans.clear()
        self.replies.clear()
        self.deferred_allocs.clear()
        self.forecasts.clear()
        return moved

    def forecast(self, alloc: AllocRequest) -> tuple[AllocReply | None, bool]:
        """The kvstore's reply where known without asking, and whether the deferred requests go now."""
        if self.reset_kv or len(self.deferred_allocs) >= MAX_DEFERRED_ALLOCS:
            return None, True
        pending = self.sched.pending_step
        reply = forecast_reply(alloc, pending, self.sched.block_size)
        return reply, reply is None or run_ends_next(pending, self.sched.block_size)

    def load_blocks(self) -> int:
        """Blocks held in its pool plus the new blocks of requests waiting here (preempted: all)."""
        waiting = self.waiting()
        self.new_blocks = {r.request_id: self.new_blocks[r.request_id] for r in waiting
                           if r.request_id in self.new_blocks and not r.num_preemptions}
        block_size, new_blocks = self.hello.block_size, self.new_blocks
        return self.held_blocks + sum(new_blocks[r.request_id] if r.request_id in new_blocks
                                      else -(-r.num_tokens // block_size) for r in waiting)

    def waiting(self) -> list[Request]:
        return [r for r in self.sched.live_requests() if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]

    def counters(self) -> Counter[str]:
        stats = self.sched.stats()
        return Counter({**{key: getattr(stats, key) for key in COUNTERS}, **self.sched.spec_decode_totals()})



class WorkerTable:
    """Every live worker's lane and the unplaced requests; methods that end requests return deltas."""

    def __init__(self, make_scheduler: Callable[[], Scheduler], router: Router) -> None:
        self.make_scheduler, self.router = make_scheduler, router
        self.template = make_scheduler()  # admission bounds and policy shared by every lane
        self.lanes: dict[str, WorkerLane] = {}
        self.unplaced: list[tuple[Request, bool]] = []  # (request, fresh) while no worker is live
        self.counter_base: Counter[str] = Counter()  # counters of the lanes of workers gone
        self.model: WorkerHello | None = None

    @property
    def policy(self):
        return self.template.policy

    def join(self, hello: WorkerHello, incarnation: str, step_ids_from: int) -> tuple[WorkerLane, list[RequestDelta]]:
        self.model = hello
        lane = self.lanes.get(hello.worker_id)
        if lane is not None:
            lane.hello, lane.incarnation = hello, incarnation
        else:
            sched = self.make_scheduler()
            sched.policy = self.policy
            sched.start_step_ids_at(step_ids_from)
            lane = self.lanes[hello.worker_id] = WorkerLane(hello, sched, incarnation)
        self.router.index.drop(hello.worker_id)
        # a request longer than the whole pool could never be admitted again once preempted
        lane.sched.max_model_len = min(hello.max_model_len, hello.num_blocks * hello.block_size)
        lane.sched.block_size = hello.block_size
        unplaced, self.unplaced = self.unplaced, []
        return lane, [d for request, fresh in unplaced for d in self.place(request, fresh)]

    def leave(self, lane: WorkerLane) -> tuple[list[Request], list[RequestDelta]]:
        del self.lanes[lane.worker_id]
        self.router.index.drop(lane.worker_id)
        requests, deltas = release_all(lane.sched)
        self.counter_base.update(lane.counters())
        for request in requests:
            deltas += self.place(request, fresh=False)
        return requests, deltas

    def place(self, request: Request, fresh: bool) -> list[RequestDelta]:
        """Queue the request on the router's pick (fresh: a new submission); abort deltas if refused."""
        if not self.lanes:
            self.unplaced.append((request, fresh))
            return []
        block_size, model = self.model.block_size, self.model.model
        hashes = request.block_hashes
        if hashes is None or hashes.block_size != block_size:  # hashed once, kept across moves
            hashes = request.block_hashes = BlockHashes(root_hash((model, request.cache_salt)), block_size)
        hashes.extend(request.token_ids_between(hashes.num_tokens, request.num_tokens))
        keys = [h[:KEY_BYTES] for h in hashes.hashes] if self.router.mode == "prefix" else []
        # one lane: the choice is forced, its load (a walk over its requests) moot
        candidates = [Candidate(lane.worker_id, lane.load_blocks() if len(self.lanes) > 1 else 0)
                      for lane in self.lanes.values()]
        worker_id, new_blocks = self.router.choose(keys, math.ceil(request.num_tokens / block_size), candidates)
        lane = self.lanes[worker_id]
        lane.new_blocks[request.request_id] = new_blocks
        try:
            if fresh:
                lane.sched.add_request(request)
            else:
                adopt(lane.sched, request)
        except ValueError as e:
            log.error("request %s refused: %s", request.request_id, e)
            return [final_delta(request, "abort", i) for i in child_request_ids(request.request_id, request.sampling.n)]
        return []

    def abort(self, request_id: str) -> list[RequestDelta]:
        """Abort a live request (its delta comes with its lane's next step); unplaced: deltas at once."""
        if any(lane.sched.abort_request(request_id) for lane in self.lanes.values()):
            return []
        for request, fresh in self.unplaced:
            ids = child_request_ids(request.request_id, request.sampling.n)
            if request_id in ids:
                self.unplaced.remove((request, fresh))
                return [final_delta(request, "abort", i) for i in ids]
        return []

    def max_model_len(self) -> int:
        lens = [lane.sched.max_model_len for lane in self.lanes.values()]
        return min(lens) if lens else self.model.max_model_len

    def is_busy(self) -> bool:
        return bool(self.unplaced) or any(lane.sched.has_requests() for lane in self.lanes.values())

    def stats(self) -> dict:
        lanes, unplaced = list(self.lanes.values()), [r for r, _ in self.unplaced]
        totals, workers, waiting = Counter(self.counter_base), {}, list(unplaced)
        for lane in lanes:
            counters, lane_waiting = lane.counters(), lane.waiting()
            totals.update(counters)
            waiting += lane_waiting
            workers[lane.worker_id] = {"num_requests_running": lane.sched.num_running,
                                       "num_requests_waiting": len(lane_waiting),
                                       "generation_tokens_total": counters["num_generation_tokens_total"],
                                       "prompt_tokens_computed_total": counters["num_computed_prompt_tokens_total"],
                                       "num_preemptions_total": counters["num_preemptions_total"],
                                       "load_blocks": lane.load_blocks(),
                                       "cached_blocks_indexed": self.router.index.num_cached(lane.worker_id)}
        template = self.template
        queue = queue_stats(waiting, template.max_waiting_requests, template.max_waiting_tokens)
        return {"num_requests_running": sum(lane.sched.num_running for lane in lanes),
                "num_requests_waiting": len(waiting), "num_requests_unplaced": len(unplaced),
                "num_preemptions_total": totals["num_preemptions_total"],
                "prompt_tokens_total": totals["num_prompt_tokens_total"],
                "prompt_tokens_computed_total": totals["num_computed_prompt_tokens_total"],
                "generation_tokens_total": totals["num_generation_tokens_total"],
                "num_finished_total": totals["num_finished_total"], "router": self.router.mode,
                **{key: totals[key] for key in COUNTERS[6:]},
                **{key: value for key, value in totals.items() if key.startswith("spec_decode_")},
                "workers": workers, "admission": admission_table(template.policy, queue)}
