"""`pagedserve bench control-plane`: the real scheduler, kvstore and Redis against many simulated
workers (services/bench/sim_worker.py), to find where the control plane stops scaling.

    pagedserve bench control-plane --workers 16,64,256 --step-ms 20 --per-worker 4 --duration 20

For each worker count: a fresh redis-server (its own port; or REDIS_URL with a fresh prefix), the
scheduler and kvstore as processes, the simulated workers in --procs processes, and a closed-loop
client keeping --per-worker requests per worker in flight. Over the measured window it reports:
steps/s (all workers) against the ideal workers / step time, routing decisions/s (requests placed
on a worker), tokens/s at the client, the plan hop (scheduler's XADD -> worker read) and a free
worker's wait for its next plan (p50/p99 ms), the client's inter-token time, the CPU share of the
scheduler, kvstore and Redis (1.0 = one core) and their CPU milliseconds per step (one core's
worth of steps/s is 1000 / that), and Redis's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from pagedserve.shared.codec import pack, unpack
from pagedserve.shared.messages import DeltaBatch, SamplingParams, SubmitRequest
from pagedserve.shared.redis_connect import async_client, sync_client
from pagedserve.shared.streams import FIELD, Keys

SERVICES = {"scheduler": "pagedserve.services.scheduler.main", "kvstore": "pagedserve.services.kvstore.main"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="16,64,256", help="worker counts, comma-separated")
    p.add_argument("--step-ms", type=float, default=20.0, help="each simulated step's compute time")
    p.add_argument("--per-worker", type=int, default=4, help="requests in flight per worker")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--procs", type=int, default=2, help="processes the simulated workers share")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds after the workers start, not measured")
    p.add_argument("--duration", type=float, default=20.0, help="the measured window, seconds")
    p.add_argument("--port", type=int, default=8850, help="the bench's own redis-server (unless REDIS_URL)")


def run(args: argparse.Namespace) -> int:
    for n in (int(x) for x in args.workers.split(",")):
        print(json.dumps(measure(args, n)), flush=True)
    return 0


def measure(args: argparse.Namespace, num_workers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pagedserve-cp-") as tmp:
        procs: list[subprocess.Popen] = []
        keys = Keys(f"cp-{uuid.uuid4().hex[:8]}")
        try:
            redis_url, redis_proc = _redis(args.port, tmp)
            if redis_proc is not None:
                procs.append(redis_proc)
            services = {name: _spawn([sys.executable, "-m", module, "--redis-url", redis_url, "--prefix",
                                      keys.prefix], f"{tmp}/{name}.log") for name, module in SERVICES.items()}
            procs += services.values()
            start = time.time() + 3.0 + num_workers / 50  # the workers' start, then the warm-up
            window = (start + args.warmup, start + args.warmup + args.duration)
            ids = [f"sim{i}" for i in range(num_workers)]
            sims = [_spawn([sys.executable, "-m", "pagedserve.services.bench.sim_worker", "--redis-url", redis_url,
                            "--prefix", keys.prefix, "--ids", ",".join(ids[k::args.procs]), "--step-ms",
                            str(args.step_ms), "--measure-from", str(window[0]), "--measure-to", str(window[1])],
                           f"{tmp}/sim{k}.log", stdout=subprocess.PIPE) for k in range(min(args.procs, num_workers))]
            procs += sims
            client = asyncio.run(_client(redis_url, keys, args, num_workers, window,
                                         {**services, **({"redis": redis_proc} if redis_proc else {})}))
            reports = [_report(p, window[1] + 120) for p in sims]
        finally:
            for p in reversed(procs):
                _stop(p)
            if os.environ.get("REDIS_URL"):  # a shared Redis: leave nothing behind
                r = sync_client(os.environ["REDIS_URL"])
                for key in r.scan_iter(match=f"{keys.prefix}:*", count=1000):
                    r.delete(key)
                r.close()
    seconds = window[1] - window[0]
    steps = sum(r["steps"] for r in reports)
    hop = np.array([x for r in reports for x in r["plan_hop_ms"]] or [0.0])
    wait = np.array([x for r in reports for x in r["wait_ms"]] or [0.0])
    itl = np.array(client.pop("itl_ms") or [0.0])
    # CPU per step: what caps a service's steps/s at one core, less noisy than the rates on a busy machine
    per_step = {f"{name}_ms_per_step": round(client[f"{name}_cpu"] * 1000 * seconds / steps, 3) if steps else None
                for name in ("scheduler", "kvstore", "redis")}
    return {"workers": num_workers, "step_ms": args.step_ms, "in_flight": num_workers * args.per_worker,
            "steps_per_s": round(steps / seconds, 1), "ideal_steps_per_s": round(num_workers * 1000 / args.step_ms, 1),
            "routing_per_s": round(sum(r["placements"] for r in reports) / seconds, 1),
            "tokens_per_s": round(client.pop("tokens") / seconds, 1),
            "plan_hop_ms_p50_p99": [round(float(np.percentile(hop, q)), 2) for q in (50, 99)],
            "worker_wait_ms_p50_p99": [round(float(np.percentile(wait, q)), 2) for q in (50, 99)],
            "itl_ms_p50_p99": [round(float(np.percentile(itl, q)), 2) for q in (50, 99)], **client, **per_step}


async def _client(redis_url: str, keys: Keys, args, num_workers: int, window: tuple[float, float],
                  cpu_procs: dict) -> dict:
    """Keeps num_workers * per_worker requests in flight; counts tokens and inter-token times in the window."""
    r = async_client(redis_url)
    api_id = "bench-api"
    await r.set(keys.heartbeat(f"api:{api_id}"), api_id, px=3_600_000)
    stream = keys.api_deltas(api_id)
    await r.xgroup_create(stream, "api", id="0", mkstream=True)
    sampling = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rng = random.Random(0)
    last_token: dict[str, float] = {}
    tokens, itl_ms, cpu0, cpu1, redis0, redis1 = 0, [], None, None, None, None

    async def submit() -> None:
        request_id = uuid.uuid4().hex[:12]
        prompt = [rng.randrange(10, 1000) for _ in range(args.prompt_tokens)]
        await r.xadd(keys.requests, {FIELD: pack(SubmitRequest(request_id, api_id, prompt, sampling, time.time()))})
        last_token[request_id] = time.time()

    await asyncio.sleep(max(0.0, window[0] - args.warmup - time.time()))
    for _ in range(num_workers * args.per_worker):
        await submit()
    while time.time() < window[1]:
        now = time.time()
        if cpu0 is None and now >= window[0]:
            cpu0, redis0 = _cpu(cpu_procs), await r.info("cpu")
        reply = await r.xreadgroup("api", api_id, {stream: ">"}, count=200, block=200)
        for _stream, items in reply or []:
            await r.xack(stream, "api", *[entry_id for entry_id, _ in items])
            for _entry_id, fields in items:
                for delta in unpack(fields[FIELD], DeltaBatch).deltas:
                    now = time.time()
                    if window[0] <= now < window[1] and delta.new_token_ids:
                        tokens += len(delta.new_token_ids)
                        if delta.request_id in last_token and delta.num_output_tokens > len(delta.new_token_ids):
                            itl_ms.append((now - last_token[delta.request_id]) * 1000 / len(delta.new_token_ids))
                    last_token[delta.request_id] = now
                    if delta.finish_reason is not None:
                        last_token.pop(delta.request_id, None)
                        await submit()
    cpu1, redis1 = _cpu(cpu_procs), await r.info("cpu")
    memory = await r.info("memory")
    await r.aclose()
    seconds = window[1] - window[0]
    share = {f"{name}_cpu": round((cpu1[name] - cpu0[name]) / seconds, 2) for name in cpu1 if name != "redis"}
    redis_cpu = sum(redis1[k] - redis0[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return {"tokens": tokens, "itl_ms": itl_ms, **share, "redis_cpu": round(redis_cpu / seconds, 2),
            "redis_memory_mib": round(memory["used_memory"] / 2**20, 1)}


def _report(proc: subprocess.Popen, deadline: float) -> dict:
    """A simulated-worker process's counters: the first line it prints at the window's end."""
    while time.time() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line:
                return json.loads(line)
            raise RuntimeError(f"simulated workers exited with {proc.wait()} before their report")
    raise RuntimeError("no report from the simulated workers in 120 s after the window")


def _cpu(procs: dict) -> dict[str, float]:
    """CPU seconds (user + system) of each process so far, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, proc in procs.items():
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _redis(port: int, tmp: str) -> tuple[str, subprocess.Popen | None]:
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"], None
    from pagedserve.services.launcher.embedded_redis import find_redis_server

    proc = _spawn([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                   "no", "--dir", tmp], f"{tmp}/redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    client, deadline = sync_client(url), time.time() + 30
    while True:
        try:
            client.ping()
            client.close()
            return url, proc
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def _spawn(argv: list[str], log_path: str, stdout=None) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115  (the child owns it)
    return subprocess.Popen(argv, stdout=stdout or log, stderr=log, text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
