"""Simulated workers for the control-plane bench: each says hello, keeps a lease and answers every
StepPlan after a set step time with one token per request that reached the end of its known
tokens, as a GPU worker looks to the scheduler and kvstore, without a model.

    python -m pagedserve.services.bench.sim_worker --redis-url URL --prefix P --ids w0,w1,... \
        --step-ms 20 --measure-from T0 --measure-to T1

Several workers share one process (asyncio tasks, each with its own Redis connection); at T1 the
process prints its counters for [T0, T1] as one JSON line and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
import zlib

from pagedserve.shared import redis_io
from pagedserve.shared.messages import SampledToken, StepPlan, StepResult, WorkerHello
from pagedserve.shared.redis_connect import async_client
from pagedserve.shared.streams import Keys

EOS = 1  # never sampled: requests end by max_tokens
VOCAB = 1000


class Window:
    """Counters and latency samples of the measured window, shared by a process's workers."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.steps = 0
        self.placements = 0  # requests a plan gave a worker in full (new or resumed): routing decisions
        self.tokens = 0
        self.plan_hop_ms: list[float] = []  # the scheduler's XADD of a plan -> the worker reads it
        self.wait_ms: list[float] = []  # a worker free, no plan yet: the control plane kept it waiting

    def open(self) -> bool:
        return self.start <= time.time() < self.end


class SimWorker:
    def __init__(self, r, keys: Keys, worker_id: str, step_s: float, num_blocks: int, block_size: int,
                 window: Window) -> None:
        self.r, self.keys, self.worker_id, self.step_s = r, keys, worker_id, step_s
        self.num_blocks, self.block_size, self.window = num_blocks, block_size, window
        self.known: dict[str, int] = {}  # request id -> its known tokens (prompt + sampled)

    async def run(self, stop: asyncio.Event) -> None:
        plans = self.keys.worker_plan(self.worker_id)
        await redis_io.ensure_group(self.r, plans, "worker", skip_backlog=True)
        heartbeat = redis_io.Heartbeat(self.r, self.keys, f"worker:{self.worker_id}", uuid.uuid4().hex)
        await heartbeat.start()
        await redis_io.send(self.r, self.keys.worker_hello, WorkerHello(
            self.worker_id, self.num_blocks, self.block_size, "sim", 4096, [EOS]), maxlen=1000)
        queue: asyncio.Queue = asyncio.Queue(maxsize=2)  # read ahead, as the real worker
        reader = asyncio.create_task(self._read(plans, queue))
        try:
            while not stop.is_set():
                free_at = time.time()
                try:
                    entry = await asyncio.wait_for(queue.get(), 0.5)
                except TimeoutError:
                    continue
                if self.window.open():
                    self.window.wait_ms.append((time.time() - free_at) * 1000)
                await asyncio.sleep(self.step_s)  # the step's compute
                result = self.execute(entry.message)
                result.worker_id = self.worker_id
                await redis_io.send(self.r, self.keys.worker_results, result)
        finally:
            reader.cancel()
            await heartbeat.stop()

    async def _read(self, plans: str, queue: asyncio.Queue) -> None:
        consumer = f"worker-{self.worker_id}"
        while True:
            for entry in await redis_io.read_group(self.r, "worker", consumer, {plans: (StepPlan,)}, 1000):
                if entry.message is None:
                    continue
                if self.window.open():
                    sent_ms = int(entry.entry_id.split(b"-")[0])
                    self.window.plan_hop_ms.append(time.time() * 1000 - sent_ms)
                await queue.put(entry)

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.reset:
            self.known.clear()
        for request_id in plan.finished_request_ids:
            self.known.pop(request_id, None)
        sampled: list[SampledToken] = []
        ends = [(n.request_id, n.num_computed_tokens + n.num_scheduled_tokens, len(n.token_ids), 1)
                for n in plan.new_requests]
        for new in plan.new_requests:
            self.known[new.request_id] = len(new.token_ids)
        ends += [(c.request_id, c.num_computed_tokens + c.num_scheduled_tokens, self.known.get(c.request_id),
                  c.num_steps) for c in plan.cached_requests]
        for request_id, end, known, num_steps in ends:
            if known is not None and end >= known:
                for position in range(known, known + num_steps):
                    sampled.append(SampledToken(request_id, 10 + zlib.crc32(f"{request_id}:{position}".encode())
                                                % VOCAB))
                self.known[request_id] = known + num_steps
        if self.window.open():
            self.window.steps += 1
            self.window.placements += len(plan.new_requests)
            self.window.tokens += len(sampled)
        return StepResult(plan.step_id, sampled, compiled_grammars=[g.key for g in plan.compile_grammars])


async def main_async(args: argparse.Namespace) -> None:
    keys, stop = Keys(args.prefix), asyncio.Event()
    window = Window(args.measure_from, args.measure_to)
    clients = [async_client(args.redis_url) for _ in args.ids]
    workers = [SimWorker(r, keys, wid, args.step_ms / 1000, args.num_blocks, args.block_size, window)
               for r, wid in zip(clients, args.ids, strict=True)]
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    await asyncio.sleep(max(0.0, args.measure_to - time.time()))
    # the counters first: a process this busy may take long to wind its workers down
    print(json.dumps({"workers": len(workers), "steps": window.steps, "placements": window.placements,
                      "tokens": window.tokens, "plan_hop_ms": window.plan_hop_ms, "wait_ms": window.wait_ms}),
          flush=True)
    stop.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    for r in clients:
        with contextlib.suppress(Exception):
            await r.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--ids", type=lambda s: s.split(","), required=True)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--measure-from", type=float, required=True)
    parser.add_argument("--measure-to", type=float, required=True)
    asyncio.run(main_async(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
