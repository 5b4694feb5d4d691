"""The scheduler service's Redis loop: the only scheduler file that touches Redis.

One reader (consumer group "scheduler") follows four streams: requests (submissions and
aborts, read only once a worker has said hello, since a Request needs its eos ids),
kv_reply, worker_results and worker_hello. A step, while there is work and both peers
are up: schedule() -> AllocRequest -> the AllocReply of that step_id -> on_alloc() ->
StepPlan -> the StepResult of that step_id -> on_result() -> one DeltaBatch per api.
Submissions read meanwhile are applied between steps. The DeltaBatches and the stats of
step N go out while the kvstore allocates the next step, and no extra read is made
between steps (the waits for the replies read every stream).

Async scheduling (the default; Scheduler.max_steps_in_flight == 2): once plan N is out,
step N+1 is scheduled, allocated and planned while the worker runs N, and only then is
N's result awaited. The worker finds plan N+1 waiting when it finishes N, so the chain
scheduler -> kvstore -> scheduler -> worker is off the critical path. A reply that comes
while another is awaited (result N while the alloc reply of N+1 is) is kept for its turn.

Crash handling. Step ids start at the wall clock in microseconds, so a late reply to a
dead predecessor never matches. Heartbeats are checked every CHECK_INTERVAL_S, also while
a reply is awaited: a kvstore that vanished or changed incarnation, a worker that vanished
(its next hello brings it back) or changed, a reply that does not come in step_timeout_s,
a reply the core refuses, or a Redis error all end the same way: the open step is
abandoned, every running request goes back to waiting (recompute from prompt + tokens so
far), and the next AllocRequest and StepPlan carry reset=True. An api whose heartbeat
expired keeps its requests (its records are in Redis; restarted, it reads its deltas on).
A request the worker fails in MAX_STRIKES consecutive failed steps is aborted, so one
poisonous request cannot stall the rest for ever.

Policy swaps (SetPolicy) arrive on the requests stream and are applied with the inbox,
between steps, in order with the submissions around them; the asking api gets a
PolicyReply. The stats blob carries the policy in force and its admission table
(services.scheduler.admission), which the apis enforce.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque

from services.scheduler.api_routes import ApiRoutes, final_delta, request_from_submit
from services.scheduler.policies.registry import PolicyError, load_policy
from services.scheduler.scheduler import Scheduler
from shared import redis_io
from shared.messages import (
    AbortRequest,
    AllocReply,
    DeltaBatch,
    PolicyReply,
    PrefixCacheReset,
    SetPolicy,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerHello,
)
from shared.parallel_sampling import child_request_ids
from shared.redis_io import Heartbeat
from shared.streams import Keys

log = logging.getLogger("pagedserve.scheduler")

GROUP = CONSUMER = "scheduler"
POLL_S = 0.5  # longest a read blocks, so heartbeats are checked while waiting
CHECK_INTERVAL_S = 0.5
STATS_INTERVAL_S = 0.25  # stats at most 4 times a second while busy (a write is a Redis round trip)
MAX_STRIKES = 2


class SchedulerLoop:
    def __init__(self, r, keys: Keys, scheduler: Scheduler, step_timeout_s: float = 30.0) -> None:
        self.r, self.keys, self.sched, self.step_timeout_s = r, keys, scheduler, step_timeout_s
        self.incarnation = uuid.uuid4().hex
        self.stop = asyncio.Event()
        self.routes = ApiRoutes()
        self.apis_away: set[str] = set()  # apis with live requests and no heartbeat
        self.inbox: list[SubmitRequest | AbortRequest | SetPolicy] = []
        self.policy_replies: list[tuple[str, PolicyReply]] = []  # (api_id, reply) to send
        self.kv_commands: list[PrefixCacheReset] = []  # to the kvstore with the next flush
        self.hello: WorkerHello | None = None
        self.hello_id = (0, 0)
        self.worker_inc: str | None = None  # None: no live worker accepted
        self.kv_inc: str | None = None
        self.reset_kv = self.reset_worker = True
        # replies the open steps still owe, by (stream, step_id); None until it came
        self.replies: dict[tuple[str, int], AllocReply | StepResult | None] = {}
        self.plans: deque[StepPlan] = deque()  # sent, result not read yet; oldest first
        self.step_broken = False
        self.strikes: Counter[str] = Counter()
        self.step_id = 0
        self.next_check = 0.0
        self.last_stats = 0.0
        self.stats_dirty = True

    # ---- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        self.stop = stop
        self.sched.start_step_ids_at(time.time_ns() // 1000)
        for stream in (self.keys.kv_reply, self.keys.worker_results, self.keys.worker_hello):
            await redis_io.ensure_group(self.r, stream, GROUP, skip_backlog=True)
        await redis_io.ensure_group(self.r, self.keys.requests, GROUP)
        latest = await redis_io.latest_entry(self.r, self.keys.worker_hello, WorkerHello)
        if latest is not None:
            await self._on_hello(*latest)
        heartbeat = Heartbeat(self.r, self.keys, "scheduler", self.incarnation)
        await heartbeat.start()
        log.info("scheduler ready: prefix=%s policy=%s incarnation=%s", self.keys.prefix,
                 self.sched.policy.name, self.incarnation)
        backoff, failing = redis_io.Backoff(), False
        try:
            while not stop.is_set():
                try:
                    await self._iteration()
                    backoff.reset()
                    failing = False
                except redis_io.REDIS_ERRORS as e:
                    delay = backoff.next()
                    log.error("redis error: %s; retrying in %.1fs", e, delay)
                    # a step may have been cut in half: abandon it, start the peers afresh
                    self._peers_failed("redis error", quiet=failing)
                    failing = True
                    await asyncio.sleep(delay)
        finally:
            await heartbeat.stop()
        return 0

    def _ready(self) -> bool:
        return self.kv_inc is not None and self.worker_inc is not None

    async def _iteration(self) -> None:
        stepping = self._ready() and self.sched.has_requests()
        if not stepping:  # while stepping, the waits for the peers' replies read every stream
            await self._poll(None if self._ready() and self.inbox else POLL_S)
        self._apply_inbox()
        if self._ready() and self.sched.has_requests():
            await self._step()
        else:
            await self._flush_outbox()
            await self._write_stats()

    async def _step(self) -> None:
        """Plan a step if one may be and it pays (always with none in flight); then read
        the oldest result, unless another step can be planned first."""
        sched = self.sched
        if sched.can_schedule() and (not sched.num_steps_in_flight or sched.has_work_ahead()):
            await self._plan_step()
            if sched.can_schedule() and sched.has_work_ahead():
                return
        if self.plans:
            outbox = asyncio.ensure_future(self._flush_outbox_and_stats())  # the last result's deltas
            try:
                await self._read_result()
            finally:
                await outbox

    async def _plan_step(self) -> None:
        self.step_broken = False
        alloc = self.sched.schedule()
        alloc.reset = self.reset_kv
        self.replies[(self.keys.kv_reply, alloc.step_id)] = None
        await redis_io.send(self.r, self.keys.kv_alloc, alloc)
        # off the critical path: the previous step's deltas and the stats go out while the
        # kvstore allocates (on their own connections), and are awaited once the plan is out
        outbox = asyncio.ensure_future(self._flush_outbox_and_stats())
        try:
            await self._send_plan(alloc)
        finally:
            await outbox

    async def _flush_outbox_and_stats(self) -> None:
        await self._flush_outbox()
        await self._write_stats()

    async def _send_plan(self, alloc) -> None:
        reply = await self._await_reply(self.keys.kv_reply, alloc.step_id, "kvstore")
        if reply is None:
            return
        try:
            plan = self.sched.on_alloc(reply)
        except (ValueError, RuntimeError) as e:
            self._peers_failed(f"kvstore reply to step {alloc.step_id} refused: {e}")
            return
        self.reset_kv = False
        plan.reset = self.reset_worker
        self.reset_worker = False  # a reset plan is followed by plain ones; a failure sets it again
        self.replies[(self.keys.worker_results, plan.step_id)] = None
        self.plans.append(plan)
        await redis_io.send(self.r, self.keys.worker_plan(self.hello.worker_id), plan)

    async def _read_result(self) -> None:
        self.step_broken = False
        plan = self.plans[0]
        result = await self._await_reply(self.keys.worker_results, plan.step_id, "worker")
        if result is None:
            return
        self.plans.popleft()
        try:
            deltas = self.sched.on_result(result)
        except (ValueError, RuntimeError) as e:
            self._worker_failed(plan, result, e)
            return
        self.strikes.clear()
        self.step_id = plan.step_id
        for delta in deltas:
            self.routes.route(delta)
        # flushed once the next step's AllocRequest is out (or at once when nothing is left)
        self.stats_dirty = True

    async def _await_reply(self, stream: str, step_id: int, peer: str):
        """The reply of this step, or None if the step was abandoned meanwhile."""
        key = (stream, step_id)
        deadline = time.monotonic() + self.step_timeout_s
        while self.replies.get(key) is None and not self.step_broken and not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self._peers_failed(f"{peer} did not answer step {step_id} in {self.step_timeout_s:.0f}s")
                break
            await self._poll(min(left, POLL_S))
        if self.step_broken or self.stop.is_set():
            return None
        return self.replies.pop(key)

    # ---- reading -------------------------------------------------------------------------

    async def _poll(self, block_s: float | None) -> None:
        streams = {self.keys.worker_hello: (WorkerHello,), self.keys.kv_reply: (AllocReply,),
                   self.keys.worker_results: (StepResult,)}
        if self.hello is not None:
            streams[self.keys.requests] = (SubmitRequest, AbortRequest, SetPolicy, PrefixCacheReset)
        block_ms = None if block_s is None else max(1, int(block_s * 1000))
        for entry in await redis_io.read_group(self.r, GROUP, CONSUMER, streams, block_ms):
            if entry.error is not None:
                log.error("bad message %s on %s: %s", entry.entry_id, entry.stream, entry.error)
                if any(stream == entry.stream for stream, _ in self.replies):
                    self._peers_failed(f"undecodable reply on {entry.stream}")
            elif entry.stream == self.keys.requests:
                self.inbox.append(entry.message)
            elif entry.stream == self.keys.worker_hello:
                await self._on_hello(entry.entry_id, entry.message)
            elif self.replies.get((entry.stream, entry.message.step_id), False) is None:
                self.replies[(entry.stream, entry.message.step_id)] = entry.message
            else:
                log.debug("stale reply for step %s on %s ignored", entry.message.step_id, entry.stream)
        if time.monotonic() >= self.next_check:
            await self._check_heartbeats()

    async def _on_hello(self, entry_id: bytes, hello: WorkerHello) -> None:
        if redis_io.stream_id_tuple(entry_id) <= self.hello_id:
            return  # seen at bootstrap already
        self.hello_id = redis_io.stream_id_tuple(entry_id)
        had_worker = self.worker_inc is not None
        self.hello = hello
        self.worker_inc = await redis_io.get_incarnation(self.r, self.keys, f"worker:{hello.worker_id}")
        # a request longer than the whole pool could never be admitted again once preempted
        self.sched.max_model_len = min(hello.max_model_len, hello.num_blocks * hello.block_size)
        log.info("worker %s joined: model=%s num_blocks=%d block_size=%d max_model_len=%d%s", hello.worker_id,
                 hello.model, hello.num_blocks, hello.block_size, self.sched.max_model_len,
                 "" if self.worker_inc else " (no heartbeat: waiting for a live worker)")
        if had_worker:
            self._peers_failed(f"worker {hello.worker_id} restarted")
        self.reset_kv = self.reset_worker = True

    async def _check_heartbeats(self) -> None:
        self.next_check = time.monotonic() + CHECK_INTERVAL_S
        names = ["kvstore"] + ([f"worker:{self.hello.worker_id}"] if self.hello is not None else [])
        apis = self.routes.api_ids()
        values = await self.r.mget([self.keys.heartbeat(n) for n in names] + [self.keys.heartbeat(f"api:{a}")
                                                                             for a in apis])
        kv_inc = values[0].decode() if values[0] is not None else None
        if kv_inc != self.kv_inc:
            if self.kv_inc is not None:
                self._peers_failed("kvstore lost" if kv_inc is None else "kvstore restarted")
            elif kv_inc is not None:
                log.info("kvstore joined (incarnation %s)", kv_inc)
            self.kv_inc = kv_inc
            self.reset_kv = self.reset_worker = True
        if self.worker_inc is not None and (values[1] or b"").decode() != self.worker_inc:
            self._peers_failed(f"worker {self.hello.worker_id} lost")
            self.worker_inc = None
        # an api without heartbeat keeps its requests: their records live in Redis, and the api,
        # restarted under the same id, reads its deltas stream on (a Redis restart silences all)
        away = {a for a, v in zip(apis, values[len(names):], strict=True) if v is None}
        for api_id in sorted(away - self.apis_away):
            log.warning("api %s has no heartbeat: its %d requests go on", api_id, len(self.routes.requests_of(api_id)))
        self.apis_away = away

    # ---- requests in, deltas out ---------------------------------------------------------

    def _apply_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for message in inbox:
            if isinstance(message, AbortRequest):
                self.sched.abort_request(message.request_id)  # unknown/finished: a no-op
            elif isinstance(message, SetPolicy):
                self._set_policy(message)
            elif isinstance(message, PrefixCacheReset):
                self.kv_commands.append(message)  # to the kvstore, between two steps
            else:
                self._submit(message)
        self.stats_dirty = self.stats_dirty or bool(inbox)  # the admission table changed

    def _set_policy(self, command: SetPolicy) -> None:
        """Between steps (the inbox is applied only there): running requests keep running,
        nothing is dropped; the next step is ordered by the new policy."""
        try:
            policy = load_policy(command.name, command.options if isinstance(command.options, dict) else None)
        except PolicyError as e:
            log.warning("policy change to %r refused: %s", command.name, e)
            reply = PolicyReply(command.command_id, False, self.sched.policy.describe(), str(e))
        else:
            log.info("policy changed: %s -> %s", self.sched.policy.describe(), policy.describe())
            self.sched.set_policy(policy)
            reply = PolicyReply(command.command_id, True, policy.describe())
        self.policy_replies.append((command.api_id, reply))

    def _submit(self, sub: SubmitRequest) -> None:
        # n > 1: the deltas are the children's (shared/parallel_sampling.py), the api listens to those
        sequence_ids = child_request_ids(sub.request_id, sub.sampling.n)
        if any(self.routes.is_known(request_id) for request_id in sequence_ids):
            log.debug("duplicate submission %s ignored", sub.request_id)
            return
        request = request_from_submit(sub, self.hello.eos_token_ids)
        done = request.stop_status(self.sched.max_model_len)
        if done is not None:  # its last token was delivered before the old scheduler died
            self.routes.route(final_delta(request, done.finish_reason), sub.api_id)
            return
        try:
            self.sched.add_request(request)
        except ValueError as e:
            log.error("request %s from api %s refused: %s", sub.request_id, sub.api_id, e)
            for request_id in sequence_ids:
                self.routes.route(final_delta(request, "abort", request_id), sub.api_id)
            return
        for request_id in sequence_ids:
            self.routes.add(request_id, sub.api_id)

    async def _flush_outbox(self) -> None:
        commands, self.kv_commands = self.kv_commands, []
        for command in commands:
            await redis_io.send(self.r, self.keys.kv_alloc, command)
        replies, self.policy_replies = self.policy_replies, []
        for api_id, reply in replies:
            await redis_io.send(self.r, self.keys.api_deltas(api_id), reply)
        outbox = self.routes.take()
        try:
            for api_id, deltas in list(outbox.items()):
                await redis_io.send(self.r, self.keys.api_deltas(api_id), DeltaBatch(self.step_id, deltas))
                del outbox[api_id]
        finally:
            self.routes.restore(outbox)  # a Redis error: sent again next flush (the api drops repeats)

    # ---- failures ------------------------------------------------------------------------

    def _peers_failed(self, reason: str, quiet: bool = False) -> None:
        moved = self.sched.preempt_all()
        if moved or not quiet:
            log.log(logging.ERROR if moved else logging.WARNING,
                    "%s: %d running requests back to waiting; kvstore and worker will be reset", reason, len(moved))
        self.reset_kv = self.reset_worker = True
        self.step_broken = True
        self.stats_dirty = True
        self.replies.clear()  # every open step is abandoned: late replies are stale
        self.plans.clear()

    def _worker_failed(self, plan: StepPlan, result: StepResult, error: Exception) -> None:
        sampled = {token.request_id for token in result.sampled}
        scheduled = [r.request_id for r in plan.new_requests] + [r.request_id for r in plan.cached_requests]
        self._peers_failed(f"worker result of step {plan.step_id} refused: {error}")
        for request_id in scheduled:
            if request_id not in sampled:
                self.strikes[request_id] += 1
                if self.strikes[request_id] >= MAX_STRIKES and self.sched.abort_request(request_id):
                    log.error("request %s aborted: the worker failed it %d steps in a row", request_id, MAX_STRIKES)

    async def _write_stats(self) -> None:
        busy = self.sched.has_requests()
        if not self.stats_dirty or (busy and time.monotonic() - self.last_stats < STATS_INTERVAL_S):
            return
        s = self.sched.stats()
        await redis_io.write_stats(self.r, self.keys, "scheduler", {
            "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
            "num_preemptions_total": s.num_preemptions_total, "prompt_tokens_total": s.num_prompt_tokens_total,
            "prompt_tokens_computed_total": s.num_computed_prompt_tokens_total,
            "generation_tokens_total": s.num_generation_tokens_total, "num_finished_total": s.num_finished_total,
            "step_id": self.step_id, "incarnation": self.incarnation, "policy": self.sched.policy.describe(),
            "admission": self.sched.admission_table()})
        self.last_stats, self.stats_dirty = time.monotonic(), busy

