"""The worker's Redis loop: heartbeat (the lease) before hello, then one StepResult per StepPlan;
a bad plan is answered empty or loses the requests it cannot run, never killing the worker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid

from pagedserve.services.gpu_worker import tier_blocks
from pagedserve.services.gpu_worker.pack_buffers import PackBuffers
from pagedserve.services.gpu_worker.tier_fills import TierFills
from pagedserve.services.gpu_worker.tier_writer import TierWriter
from pagedserve.shared import kv_tier, redis_io
from pagedserve.shared.messages import CachedRequestData, NewRequestData, StepPlan, StepResult, WorkerHello
from pagedserve.shared.redis_io import Entry, Heartbeat
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.worker")

GROUP = "worker"
HELLO_MAXLEN = 1000
PLANS_AHEAD = 2  # plans read ahead of the step running (the scheduler has at most 2 in flight)
STOP_POLL_S = 1.0
MAX_STEPS_PER_PLAN = 1024
TIER_LOAD_TIMEOUT_S = 5.0  # past it the worker computes the blocks it meant to load
PACK_BUFFERS_FREE_BYTES = 256 << 20  # kept for packing stores: 2 steps of 2,048 tokens, SmolLM2 float32


class WorkerLoop:
    def __init__(self, r, keys: Keys, worker, worker_id: str, model: str, max_model_len: int,
                 compute: concurrent.futures.Executor, tier_client) -> None:
        self.r, self.keys, self.worker, self.worker_id = r, keys, worker, worker_id
        self.compute = compute  # the one thread that runs torch in this process
        self.model, self.max_model_len = model, max_model_len
        self.incarnation = uuid.uuid4().hex
        self.last_step_id: int | None = None
        self.synced = False  # a reset plan has come since this worker started
        kv_caches = worker.pool.kv_caches
        self.tier_namespace = tier_blocks.pool_namespace(model, kv_caches, worker.block_size)
        self.tier_block_bytes = tier_blocks.block_bytes(kv_caches)
        # a result waits for its step's eager stores and for the others of steps stores_lag before it
        self.tier_writer = TierWriter(tier_client, keys, self.tier_namespace)
        self.tier_fills = TierFills(worker.block_size)
        self.pack_buffers = PackBuffers(self.tier_block_bytes, PACK_BUFFERS_FREE_BYTES)

    async def run(self, stop: asyncio.Event) -> int:
        plans = self.keys.worker_plan(self.worker_id)
        await redis_io.ensure_group(self.r, plans, GROUP, skip_backlog=True)
        heartbeat = Heartbeat(self.r, self.keys, f"worker:{self.worker_id}", self.incarnation)
        await heartbeat.start()
        hello = WorkerHello(self.worker_id, self.worker.num_blocks, self.worker.block_size, self.model,
                            self.max_model_len, list(self.worker.model_config.eos_token_ids),
                            self.tier_namespace, self.tier_block_bytes)
        await redis_io.send(self.r, self.keys.worker_hello, hello, maxlen=HELLO_MAXLEN)
        log.info("worker %s ready: said hello (num_blocks=%d block_size=%d max_model_len=%d) incarnation=%s",
                 self.worker_id, hello.num_blocks, hello.block_size, hello.max_model_len, self.incarnation)
        # plans are read and results sent while a step runs: the compute thread never waits on Redis
        entries: asyncio.Queue[Entry] = asyncio.Queue(maxsize=PLANS_AHEAD)
        results: asyncio.Queue[tuple[StepResult, int]] = asyncio.Queue()  # (result, wait for writes through)
        reader = asyncio.create_task(self._read_plans(plans, f"worker-{self.worker_id}", entries))
        sender = asyncio.create_task(self._send_results(results))
        # a restarted Redis lost the hello, the group and the lease: say them again, lease first
        rejoin = asyncio.create_task(redis_io.on_restart(self.r, lambda: self._rejoin(heartbeat, hello, plans)))
        try:
            while not stop.is_set():
                try:
                    entry = await asyncio.wait_for(entries.get(), STOP_POLL_S)
                except TimeoutError:
                    for task in (reader, sender):
                        if task.done():
                            task.result()  # a bug, not Redis (that is retried): fatal, with its traceback
                    continue
                result = await self._execute(entry)
                if result is not None:
                    result.worker_id = self.worker_id
                    lag = entry.message.stores_lag if entry.message is not None else 0
                    results.put_nowait((result, result.step_id - lag))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(results.join(), STOP_POLL_S)
        finally:
            for task in (reader, sender, rejoin):
                task.cancel()
            await asyncio.gather(reader, sender, rejoin, return_exceptions=True)
            await heartbeat.stop()
            self.tier_writer.close()
        return 0

    async def _rejoin(self, heartbeat: Heartbeat, hello: WorkerHello, plans: str) -> None:
        await heartbeat.start_beat()
        await redis_io.ensure_group(self.r, plans, GROUP)  # empty since the restart: nothing stale to skip
        await redis_io.send(self.r, self.keys.worker_hello, hello, maxlen=HELLO_MAXLEN)
        log.warning("worker %s: redis restarted; said hello again", self.worker_id)

    async def _read_plans(self, stream: str, consumer: str, entries: asyncio.Queue) -> None:
        backoff = redis_io.Backoff()
        while True:
            try:
                for entry in await redis_io.read_group(self.r, GROUP, consumer, {stream: (StepPlan,)}, 1000):
                    await entries.put(entry)
                backoff.reset()
            except redis_io.REDIS_ERRORS as e:
                delay = backoff.next()
                log.error("redis error reading plans: %s; retrying in %.1fs", e, delay)
                await asyncio.sleep(delay)

    async def _send_results(self, results: asyncio.Queue) -> None:
        """In step order; each retried until Redis takes it."""
        backoff = redis_io.Backoff()
        while True:
            result, stored_through = await results.get()
            await self.tier_writer.wait_through(stored_through, TIER_LOAD_TIMEOUT_S, eager_step=result.step_id)
            result.tier_written = self.tier_writer.take_written()
            result.tier_filled = self.tier_writer.take_filled()
            while True:
                try:
                    await redis_io.send(self.r, self.keys.worker_results, result)
                    backoff.reset()
                    break
                except redis_io.REDIS_ERRORS as e:
                    delay = backoff.next()
                    log.error("redis error sending the result of step %d: %s; retrying in %.1fs",
                              result.step_id, e, delay)
                    await asyncio.sleep(delay)
            results.task_done()

    async def _execute(self, entry: Entry) -> StepResult | None:
        plan: StepPlan | None = entry.message
        if plan is None:
            step_id = redis_io.peek_step_id(entry.raw)
            log.error("bad plan %s (step %s): %s", entry.entry_id, step_id, entry.error)
            return StepResult(step_id) if step_id is not None else None
        if not plan.reset and self.last_step_id is not None and plan.step_id <= self.last_step_id:
            log.warning("plan for step %d redelivered (last %d): dropped", plan.step_id, self.last_step_id)
            return None
        self.last_step_id = plan.step_id
        if not plan.reset and not self.synced:
            log.warning("plan for step %d before the scheduler's reset: answered empty", plan.step_id)
            return StepResult(plan.step_id)
        self.synced = True
        if plan.reset:
            log.info("reset by the scheduler at step %d (%d requests dropped)", plan.step_id,
                     len(self.worker.requests))
        for request_id, why in drop_bad_requests(plan, self.worker):
            log.error("step %d: request %s dropped from the plan: %s", plan.step_id, request_id, why)
        try:
            started = time.perf_counter()
            blobs = await kv_tier.load_blocks(self.r, self.keys, self.tier_namespace,
                                              tier_blocks.hashes_to_load(plan), TIER_LOAD_TIMEOUT_S)
            load_seconds = time.perf_counter() - started if blobs else 0.0
            result, moved = await asyncio.get_running_loop().run_in_executor(
                self.compute, tier_blocks.execute, self.worker, plan, blobs, self.pack_buffers, self.tier_fills)
            result.tier_load_seconds = load_seconds
            result.tier_loaded_bytes = result.num_tier_loaded_blocks * self.tier_block_bytes
            self.tier_writer.tally.take_into(result)
            if moved.eager:  # first: its result waits for these, and the writer keeps the order
                self.tier_writer.submit(plan.step_id, moved.eager, lambda: self.pack_buffers.give(moved.eager_buffer),
                                        eager=True, filled=moved.filled)
            if moved.stores:
                self.tier_writer.submit(plan.step_id, moved.stores, lambda: self.pack_buffers.give(moved.buffer))
            return result
        except Exception as e:  # the model or the pool refused it: answer, never die
            log.error("step %d failed: %s: %s", plan.step_id, type(e).__name__, e, exc_info=True)
            return StepResult(plan.step_id)


def drop_bad_requests(plan: StepPlan, worker) -> list[tuple[str, str]]:
    """Remove from the plan (in place) the requests the worker cannot run; (id, why) each."""
    known = set() if plan.reset else set(worker.requests)
    known.difference_update(plan.finished_request_ids)
    vocab, num_blocks, block_size = worker.model_config.vocab_size, worker.num_blocks, worker.block_size
    dropped: list[tuple[str, str]] = []

    def bad_blocks(block_ids: list[int]) -> bool:
        return any(not 0 <= b < num_blocks for b in block_ids)

    new_requests: list[NewRequestData] = []
    for new in plan.new_requests:
        end = new.num_computed_tokens + new.num_scheduled_tokens
        in_range = 0 <= new.num_computed_tokens <= end <= len(new.token_ids)
        why = ("token id out of range" if any(not 0 <= t < vocab for t in new.token_ids)
               else "block id out of range" if bad_blocks(new.block_ids)
               else f"schedules up to {end} of {len(new.token_ids)} tokens" if not in_range
               else f"{len(new.block_ids)} blocks for {end} tokens" if len(new.block_ids) * block_size < end
               else None)
        if why is None:
            new_requests.append(new)
            known.add(new.request_id)
        else:
            dropped.append((new.request_id, why))
    cached_requests: list[CachedRequestData] = []
    for cached in plan.cached_requests:
        state = worker.requests.get(cached.request_id) if cached.request_id in known else None
        end = cached.num_computed_tokens + cached.num_scheduled_tokens
        known_end = end - len(cached.draft_token_ids)  # drafts are inputs beyond the known tokens
        multi_step = cached.num_steps != 1
        end += cached.num_steps - 1
        why = ("unknown request" if state is None
               else f"num_steps={cached.num_steps}" if not 1 <= cached.num_steps <= MAX_STEPS_PER_PLAN
               else "multi-step but not one decode token" if multi_step and (
                   cached.draft_token_ids or cached.num_scheduled_tokens != 1 or known_end != len(state.token_ids))
               else "block id out of range" if bad_blocks(cached.new_block_ids)
               else "draft token id out of range" if any(not 0 <= t < vocab for t in cached.draft_token_ids)
               else "drafts not right after its last token" if cached.draft_token_ids and not (
                   cached.num_computed_tokens < known_end == len(state.token_ids))
               else f"schedules {known_end} of {len(state.token_ids)} tokens" if known_end > len(state.token_ids)
               else "too few blocks" if (len(state.block_ids) + len(cached.new_block_ids)) * block_size < end
               else None)
        if why is None:
            cached_requests.append(cached)
        else:
            dropped.append((cached.request_id, why))
    if any(bad_blocks(list(pair)) for pair in plan.block_copies):
        dropped.append(("(block copies)", "block id out of range"))
        plan.block_copies = []
    plan.new_requests, plan.cached_requests = new_requests, cached_requests
    return dropped
