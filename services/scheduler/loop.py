"""The scheduler service's Redis loop (the only scheduler file that touches Redis).

Each worker has a lane (its own Scheduler) that steps on its own: schedule() -> kv_alloc ->
on_alloc() -> worker_plan -> on_result() -> deltas, so a slow worker delays only its lane.
A kvstore restart or Redis error abandons every lane's open steps (requests recompute); a
timeout or refused reply does so for one lane; a dead worker's requests move to survivors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from pagedserve.services.scheduler.alloc_forecast import differs
from pagedserve.services.scheduler.api_routes import ApiRoutes, final_delta, request_from_submit
from pagedserve.services.scheduler.placement import Router
from pagedserve.services.scheduler.policies.registry import PolicyError, load_policy
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.services.scheduler.workers import WorkerLane, WorkerTable
from pagedserve.shared import redis_io
from pagedserve.shared.messages import (
    AbortRequest,
    AllocReply,
    CommandReply,
    DeltaBatch,
    PrefixCacheReset,
    RequestDelta,
    SetPolicy,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerHello,
)
from pagedserve.shared.parallel_sampling import child_request_ids
from pagedserve.shared.redis_io import Heartbeat
from pagedserve.shared.streams import HEARTBEAT_TTL_S, Keys

log = logging.getLogger("pagedserve.scheduler")

GROUP = CONSUMER = "scheduler"
POLL_S = 0.5
CHECK_INTERVAL_S = 0.5
STATS_INTERVAL_S = 0.25  # while busy: a stats write is a Redis round trip
MAX_STRIKES = 2
HELLO_SCAN = 1000  # hellos read back at start


class SchedulerLoop:
    def __init__(self, r, keys: Keys, make_scheduler: Callable[[], Scheduler], step_timeout_s: float = 30.0,
                 router: Router | None = None) -> None:
        self.r, self.keys, self.step_timeout_s = r, keys, step_timeout_s
        self.workers = WorkerTable(make_scheduler, router or Router())
        self.lanes = self.workers.lanes
        self.incarnation = uuid.uuid4().hex
        self.stop = asyncio.Event()
        self.routes = ApiRoutes()
        self.apis_away: set[str] = set()
        self.redis_trouble_at = float("-inf")
        self.inbox: list[SubmitRequest | AbortRequest | SetPolicy | PrefixCacheReset] = []
        self.policy_replies: list[tuple[str, CommandReply]] = []
        self.kv_commands: list[PrefixCacheReset] = []
        # a step's messages go out with the next poll, in its round trip; deltas come back if it fails
        self.sends: list[tuple[str, object]] = []
        self.unsent: dict[str, list[RequestDelta]] = {}
        self.hello_ids: dict[str, tuple[int, int]] = {}
        self.kv_inc: str | None = None
        self.step_id = 0
        self.next_check = 0.0
        self.last_stats = 0.0
        self.stats_dirty = True

    async def run(self, stop: asyncio.Event) -> int:
        self.stop = stop
        for stream in (self.keys.kv_reply, self.keys.worker_results, self.keys.worker_hello):
            await redis_io.ensure_group(self.r, stream, GROUP, skip_backlog=True)
        await redis_io.ensure_group(self.r, self.keys.requests, GROUP)
        await self._bootstrap_workers()
        heartbeat = Heartbeat(self.r, self.keys, "scheduler", self.incarnation)
        await heartbeat.start()
        log.info("scheduler ready: prefix=%s policy=%s router=%s incarnation=%s", self.keys.prefix,
                 self.workers.policy.name, self.workers.router.mode, self.incarnation)
        backoff, failing = redis_io.Backoff(), False
        try:
            while not stop.is_set():
                try:
                    await self._poll(POLL_S)
                    self._apply_inbox()
                    for lane in list(self.lanes.values()):
                        await self._advance(lane)
                    self._flush_outbox()
                    await self._write_stats()
                    backoff.reset()
                    failing = False
                except redis_io.REDIS_ERRORS as e:
                    delay = backoff.next()
                    self.redis_trouble_at = time.monotonic()
                    log.error("redis error: %s; retrying in %.1fs", e, delay)
                    self._all_failed("redis error", quiet=failing)  # a step may have been cut in half
                    failing = True
                    await asyncio.sleep(delay)
        finally:
            with contextlib.suppress(*redis_io.REDIS_ERRORS):
                await self._send_queued()
            await heartbeat.stop()
        return 0

    async def _send_queued(self, streams: dict | None = None, block_ms: int = 0) -> list[redis_io.Entry]:
        """The queued messages, in order, then (streams given) a read of those, in one round trip."""
        sends, self.sends = self.sends, []
        unsent, self.unsent = self.unsent, {}
        try:
            if streams is None:
                await redis_io.send_all(self.r, sends)
                return []
            return await redis_io.read_group(self.r, GROUP, CONSUMER, streams, block_ms, sends=sends)
        except BaseException:
            self.routes.restore(unsent)  # resent next flush; the api drops repeats
            raise

    async def _advance(self, lane: WorkerLane) -> None:
        """Move one lane as far as its replies allow, then schedule its next step if it may and pays."""
        sched = lane.sched
        while True:
            if lane.awaiting_alloc is not None and ("alloc", lane.awaiting_alloc) in lane.replies:
                await self._send_plan(lane, lane.replies.pop(("alloc", lane.awaiting_alloc)))
            elif lane.plans and ("result", lane.plans[0].step_id) in lane.replies:
                self._read_result(lane, lane.replies.pop(("result", lane.plans[0].step_id)))
            elif (self.kv_inc is not None and sched.has_requests() and sched.can_schedule()
                  and (not sched.num_steps_in_flight or sched.has_work_ahead())):
                await self._plan_step(lane)
            else:
                break
        if lane.deferred_allocs and not lane.is_awaiting():
            self._send_deferred(lane)
        if lane.is_awaiting() and time.monotonic() > lane.deadline:
            what = "kvstore" if lane.awaiting_alloc is not None else f"worker {lane.worker_id}"
            self._lane_failed(lane, f"{what} did not answer in {self.step_timeout_s:.0f}s")

    async def _plan_step(self, lane: WorkerLane) -> None:
        if lane.sched.policy is not self.workers.policy:
            lane.sched.set_policy(self.workers.policy)
        alloc = lane.sched.schedule()
        alloc.reset, alloc.worker_id = lane.reset_kv, lane.worker_id
        lane.awaiting_alloc = alloc.step_id
        lane.touch(self.step_timeout_s)
        forecast, send_deferred = lane.forecast(alloc)
        if forecast is not None:  # planned now; the kvstore hears of it with a later request
            lane.deferred_allocs.append(alloc)
            lane.forecasts[alloc.step_id] = forecast
        if send_deferred:
            self._send_deferred(lane)
        if forecast is not None:
            await self._send_plan(lane, forecast)
        else:
            self.sends.append((self.keys.kv_alloc, alloc))

    def _send_deferred(self, lane: WorkerLane) -> None:
        self.sends += [(self.keys.kv_alloc, alloc) for alloc in lane.deferred_allocs]
        lane.deferred_allocs.clear()

    async def _send_plan(self, lane: WorkerLane, reply: AllocReply) -> None:
        lane.awaiting_alloc = None
        try:
            plan = lane.sched.on_alloc(reply)
        except (ValueError, RuntimeError) as e:
            # a restarted kvstore refuses every step until its reset: learn of the restart now, or the
            # next heartbeat check resets the lanes again, redoing what they ran since this reset
            value = await self.r.get(self.keys.heartbeat("kvstore"))
            if value is None or not self._on_kvstore(value.decode()):
                self._lane_failed(lane, f"kvstore reply to step {reply.step_id} of worker {lane.worker_id} "
                                  f"refused: {e}")
            return
        lane.reset_kv = False
        plan.reset, lane.reset_worker = lane.reset_worker, False
        lane.plans.append(plan)
        lane.touch(self.step_timeout_s)
        self.sends.append((self.keys.worker_plan(lane.worker_id), plan))

    def _read_result(self, lane: WorkerLane, result: StepResult) -> None:
        plan = lane.plans.popleft()
        lane.touch(self.step_timeout_s)
        try:
            deltas = lane.sched.on_result(result)
        except (ValueError, RuntimeError) as e:
            self._worker_failed(lane, plan, result, e)
            return
        lane.strikes.clear()
        self.step_id = max(self.step_id, plan.step_id)
        self._route([RequestDelta(p.request_id, [], prompt_logprobs=p) for p in result.prompt_logprobs])  # first
        self._route(deltas)
        self.stats_dirty = True

    async def _poll(self, block_s: float) -> None:
        streams = {self.keys.worker_hello: (WorkerHello,), self.keys.kv_reply: (AllocReply,),
                   self.keys.worker_results: (StepResult,)}
        if self.workers.model is not None:
            streams[self.keys.requests] = (SubmitRequest, AbortRequest, SetPolicy, PrefixCacheReset)
        try:
            entries, failure = await self._send_queued(streams, max(1, int(block_s * 1000))), None
        except redis_io.SendFailed as e:  # what the read took (acked) is handled, then the failure
            entries, failure = e.entries, e
        for entry in entries:
            message = entry.message
            if entry.error is not None:
                log.error("bad message %s on %s: %s", entry.entry_id, entry.stream, entry.error)
                if entry.stream in (self.keys.kv_reply, self.keys.worker_results):
                    self._all_failed(f"undecodable reply on {entry.stream}")
            elif entry.stream == self.keys.requests:
                self.inbox.append(message)
            elif entry.stream == self.keys.worker_hello:
                await self._on_hello(entry.entry_id, message)
            else:
                self._on_reply(message)
        if failure is not None:
            raise failure
        if time.monotonic() >= self.next_check:
            await self._check_heartbeats()

    def _on_reply(self, reply: AllocReply | StepResult) -> None:
        lane = self.lanes.get(reply.worker_id)
        if lane is None:
            log.debug("reply for step %s of worker %r, which is not live: ignored", reply.step_id, reply.worker_id)
            return
        kind = "alloc" if isinstance(reply, AllocReply) else "result"
        if kind == "alloc":  # the pool's changes, whether or not the step is still open
            self.workers.router.index.apply(lane.worker_id, reply.blocks_stored, reply.blocks_removed,
                                            reply.all_blocks_cleared)
            self.workers.router.index.apply_tier(reply.tier_blocks_stored, reply.tier_blocks_removed,
                                                 reply.tier_blocks_whole)
            if reply.num_blocks:
                lane.held_blocks = reply.num_blocks - reply.num_free_blocks
            forecast = lane.forecasts.pop(reply.step_id, None)
            if forecast is not None:
                wrong = differs(forecast, reply)
                if wrong is not None:
                    self._lane_failed(lane, f"kvstore reply to forecast step {reply.step_id} of worker "
                                      f"{lane.worker_id} differs: {wrong}")
                return
        if lane.expects(kind, reply.step_id):
            lane.replies[(kind, reply.step_id)] = reply
        else:
            log.debug("stale %s reply for step %s of worker %s ignored", kind, reply.step_id, lane.worker_id)

    async def _bootstrap_workers(self) -> None:
        for entry_id, hello in await redis_io.newest_per_worker(self.r, self.keys.worker_hello, WorkerHello,
                                                                 HELLO_SCAN):
            await self._on_hello(entry_id, hello)

    async def _on_hello(self, entry_id: bytes, hello: WorkerHello) -> None:
        new, incarnation = await redis_io.accept_hello(self.r, self.keys, self.hello_ids, entry_id, hello.worker_id)
        if not new:
            return
        if incarnation is None:
            log.info("hello of worker %s ignored: no heartbeat (it is gone)", hello.worker_id)
            return
        lane = self.lanes.get(hello.worker_id)
        if lane is not None and lane.incarnation == incarnation:
            return
        if lane is not None:  # restarted: an empty pool; its requests recompute there
            self._lane_failed(lane, f"worker {hello.worker_id} restarted")
        lane, deltas = self.workers.join(hello, incarnation, time.time_ns() // 1000)
        self._route(deltas)
        log.info("worker %s joined: model=%s num_blocks=%d block_size=%d max_model_len=%d (%d workers)",
                 hello.worker_id, hello.model, hello.num_blocks, hello.block_size, lane.sched.max_model_len,
                 len(self.lanes))
        self.stats_dirty = True

    async def _check_heartbeats(self) -> None:
        self.next_check = time.monotonic() + CHECK_INTERVAL_S
        lanes = list(self.lanes.values())
        apis = self.routes.api_ids()
        names = ["kvstore"] + [f"worker:{lane.worker_id}" for lane in lanes] + [f"api:{a}" for a in apis]
        values = [v.decode() if v is not None else None
                  for v in await self.r.mget([self.keys.heartbeat(n) for n in names])]
        if time.monotonic() - self.redis_trouble_at < HEARTBEAT_TTL_S:
            # after a Redis restart a missing heartbeat is not death, only a new incarnation is
            known = [self.kv_inc] + [lane.incarnation for lane in lanes]
            values[:len(known)] = [v if v is not None else k for v, k in zip(values, known, strict=False)]
        self._on_kvstore(values[0])
        for lane, value in zip(lanes, values[1:1 + len(lanes)], strict=True):
            if value != lane.incarnation:
                self._worker_left(lane, "lease expired" if value is None else "replaced by a new incarnation")
        # an api without heartbeat keeps its requests: restarted under its id, it reads its deltas on
        away = {a for a, v in zip(apis, values[1 + len(lanes):], strict=True) if v is None}
        for api_id in sorted(away - self.apis_away):
            log.warning("api %s has no heartbeat: its %d requests go on", api_id, len(self.routes.requests_of(api_id)))
        self.apis_away = away

    def _on_kvstore(self, kv_inc: str | None) -> bool:
        """The kvstore's heartbeat (None: gone); True if it changed: every lane resets its pool."""
        if kv_inc == self.kv_inc:
            return False
        if self.kv_inc is not None:
            self._all_failed("kvstore lost" if kv_inc is None else "kvstore restarted")
        elif kv_inc is not None:
            log.info("kvstore joined (incarnation %s)", kv_inc)
        self.kv_inc = kv_inc
        for lane in self.lanes.values():
            lane.reset_kv = lane.reset_worker = True
        return True

    def _apply_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for message in inbox:
            if isinstance(message, AbortRequest):
                self._route(self.workers.abort(message.request_id))
            elif isinstance(message, SetPolicy):
                self._set_policy(message)
            elif isinstance(message, PrefixCacheReset):
                self.kv_commands.append(message)
            else:
                self._submit(message)
        self.stats_dirty = self.stats_dirty or bool(inbox)

    def _set_policy(self, command: SetPolicy) -> None:
        """Lanes take the new policy before their next step; running requests keep running."""
        try:
            policy = load_policy(command.name, command.options if isinstance(command.options, dict) else None)
        except PolicyError as e:
            log.warning("policy change to %r refused: %s", command.name, e)
            reply = CommandReply(command.command_id, False, self.workers.policy.describe(), str(e))
        else:
            log.info("policy changed: %s -> %s", self.workers.policy.describe(), policy.describe())
            self.workers.template.policy = policy
            reply = CommandReply(command.command_id, True, policy.describe())
        self.policy_replies.append((command.api_id, reply))

    def _submit(self, sub: SubmitRequest) -> None:
        # n > 1: the api listens to the children's deltas
        sequence_ids = child_request_ids(sub.request_id, sub.sampling.n)
        if any(self.routes.is_known(request_id) for request_id in sequence_ids):
            log.debug("duplicate submission %s ignored", sub.request_id)
            return
        request = request_from_submit(sub, self.workers.model.eos_token_ids)
        done = request.stop_status(self.workers.max_model_len())
        if done is not None:  # its last token was delivered before the old scheduler died
            self.routes.route(final_delta(request, done.finish_reason), sub.api_id)
            return
        for request_id in sequence_ids:
            self.routes.add(request_id, sub.api_id)
        self._route(self.workers.place(request, fresh=True))

    def _route(self, deltas) -> None:
        for delta in deltas:
            self.routes.route(delta)

    def _flush_outbox(self) -> None:
        """Queue commands, replies and each api's deltas (one batch per api) after this round's steps."""
        commands, self.kv_commands = self.kv_commands, []
        self.sends += [(self.keys.kv_alloc, command) for command in commands]
        replies, self.policy_replies = self.policy_replies, []
        self.sends += [(self.keys.api_deltas(api_id), reply) for api_id, reply in replies]
        for api_id, deltas in self.routes.take().items():
            self.sends.append((self.keys.api_deltas(api_id), DeltaBatch(self.step_id, deltas)))
            self.unsent.setdefault(api_id, []).extend(deltas)

    def _lane_failed(self, lane: WorkerLane, reason: str, quiet: bool = False) -> None:
        moved = lane.abandon()
        if moved or not quiet:
            log.log(logging.ERROR if moved else logging.WARNING, "%s: %d running requests of worker %s back to "
                    "waiting; its pool and the worker will be reset", reason, len(moved), lane.worker_id)
        self.stats_dirty = True

    def _all_failed(self, reason: str, quiet: bool = False) -> None:
        for lane in self.lanes.values():
            self._lane_failed(lane, reason, quiet)

    def _worker_left(self, lane: WorkerLane, reason: str) -> None:
        requests, deltas = self.workers.leave(lane)
        self._route(deltas)
        log.warning("worker %s left (%s): %d requests moved to %s", lane.worker_id, reason, len(requests),
                    ", ".join(sorted(self.lanes)) or "the next worker to join")
        self.stats_dirty = True

    def _worker_failed(self, lane: WorkerLane, plan: StepPlan, result: StepResult, error: Exception) -> None:
        sampled = {token.request_id for token in result.sampled}
        scheduled = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.cached_requests]
        self._lane_failed(lane, f"worker result of step {plan.step_id} refused: {error}")
        for request_id in scheduled:
            if request_id not in sampled:
                lane.strikes[request_id] += 1
                if lane.strikes[request_id] >= MAX_STRIKES and lane.sched.abort_request(request_id):
                    log.error("request %s aborted: the worker failed it %d steps in a row", request_id, MAX_STRIKES)

    async def _write_stats(self) -> None:
        busy = self.workers.is_busy()
        if not self.stats_dirty or (busy and time.monotonic() - self.last_stats < STATS_INTERVAL_S):
            return
        await self._send_queued()  # a step's messages first: they wait on no stats
        blob = self.workers.stats()
        blob.update(step_id=self.step_id, incarnation=self.incarnation, policy=self.workers.policy.describe())
        await redis_io.write_stats(self.r, self.keys, "scheduler", blob)
        self.last_stats, self.stats_dirty = time.monotonic(), busy
