"""`pagedserve bench serve`: an OpenAI-compatible server (--url, or --launch `pagedserve up`) measured
over HTTP, then --baseline on a quiet machine; /metrics adds peak KV usage and prefix hit rate."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.services.bench.report import LATENCY_STATS, latency_summary, print_table, throughput_fields
from pagedserve.services.bench.serve_client import RequestRecord, run_load
from pagedserve.services.bench.stack_cpu import StackCpu
from pagedserve.services.bench.workloads import BenchRequest, load_workload
from pagedserve.services.launcher.embedded_redis import free_port

SCRAPE_EVERY_S = 0.25
DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="the server's base URL (default http://127.0.0.1:8000)")
    parser.add_argument("--launch", action="store_true", help="start `pagedserve up` for the run, stop it after")
    parser.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                        help="with --launch: one more argument for `pagedserve up` (repeatable)")
    parser.add_argument("--served-model", default=None, help="the `model` field sent (default: --model)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")


def _scrape(text: str) -> dict[str, list[float]]:
    """Each pagedserve sample name -> its samples' values, one per label set: every engine series
    is labelled by worker (docs/operations.md), so a counter's total is their sum and KV usage,
    a ratio per worker, their max."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("pagedserve:"):
                samples.setdefault(sample.name, []).append(sample.value)
    return samples


def totals(text: str) -> dict[str, float]:
    """Each pagedserve sample name -> the stack's total (the sum over its workers' series)."""
    return {name: math.fsum(values) for name, values in _scrape(text).items()}


def peak_kv_usage(text: str) -> float | None:
    """The fullest worker's KV usage (a ratio per worker), None where no worker reports one."""
    usage = _scrape(text).get("pagedserve:kv_cache_usage_perc")
    return max(usage) if usage else None


async def _watch_metrics(base_url: str, stop: asyncio.Event, peak: dict) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        while not stop.is_set():
            try:
                usage = peak_kv_usage((await client.get(base_url + "/metrics")).text)
                if usage is not None:
                    peak["kv"] = max(peak.get("kv", 0.0), usage)
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), SCRAPE_EVERY_S)
            except TimeoutError:
                pass


def _counters(base_url: str) -> dict[str, float]:
    try:
        return totals(httpx.get(base_url + "/metrics", timeout=5.0).text)
    except httpx.HTTPError:
        return {}


def served_model(args: argparse.Namespace) -> str:
    return args.served_model or args.model


def measure(base_url: str, requests: list[BenchRequest], args: argparse.Namespace, system: str,
            cpu: StackCpu | None = None) -> dict:
    """cpu: the launched stack's processes, for each service's CPU ms per step."""
    from tqdm import tqdm

    warm = [BenchRequest(requests[0].prompt_token_ids[:8], 2)]
    asyncio.run(run_load(base_url, served_model(args), warm, math.inf, None, args.api_key))
    before = _counters(base_url)
    cpu_before = cpu.snapshot_after_a_step() if cpu is not None else None

    async def go() -> tuple[list[RequestRecord], float, dict]:
        stop, peak = asyncio.Event(), {}
        watcher = asyncio.create_task(_watch_metrics(base_url, stop, peak))
        with tqdm(total=len(requests), unit="req", desc=system, leave=False) as bar:
            records, wall = await run_load(base_url, served_model(args), requests, args.request_rate,
                                           args.max_concurrency, args.api_key, args.seed,
                                           on_done=lambda _r: bar.update(1))
        stop.set()
        await watcher
        return records, wall, peak

    records, wall, peak = asyncio.run(go())
    after = _counters(base_url)
    result = summarize(system, records, wall, peak.get("kv"), before, after)
    if cpu is not None:
        time.sleep(2 * SCRAPE_EVERY_S)  # the scheduler's stats blob catches up with the last step
        result |= StackCpu.per_step(cpu_before, cpu.snapshot())
    result["model"] = _served_id(base_url, args.api_key)
    return result


def _served_id(base_url: str, api_key: str | None) -> str | None:
    """The model the server says it serves (/v1/models), so a result names what ran."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(base_url + "/v1/models", headers=headers, timeout=5.0).json().get("data") or []
    except (httpx.HTTPError, ValueError):
        return None
    return data[0].get("id") if data else None


def summarize(system: str, records: list[RequestRecord], wall: float, peak_kv: float | None,
              before: dict, after: dict) -> dict:
    ok = [r for r in records if r.ok]
    result = {"system": system, "num_failed": len(records) - len(ok),
              **throughput_fields(wall, len(ok), sum(r.num_output_tokens for r in ok),
                                  sum(r.num_prompt_tokens for r in ok))}
    result |= latency_summary("ttft", [r.ttft_s for r in ok])
    result |= latency_summary("tpot", [r.tpot_s for r in ok if r.tpot_s is not None])
    result |= latency_summary("itl", [gap for r in ok for gap in r.itl_s])
    result |= latency_summary("e2e", [r.e2e_s for r in ok])
    result["peak_kv_usage"] = math.nan if peak_kv is None else peak_kv
    queries = after.get("pagedserve:prefix_cache_queries_total", 0.0) - before.get(
        "pagedserve:prefix_cache_queries_total", 0.0)
    hits = after.get("pagedserve:prefix_cache_hits_total", 0.0) - before.get("pagedserve:prefix_cache_hits_total", 0.0)
    result["prefix_hit_rate"] = hits / queries if queries > 0 else math.nan
    errors = [r.error for r in records if not r.ok]
    if errors:
        result["first_error"] = errors[0]
    return result


class LaunchedStack:
    """`pagedserve up` as a child process on a free port, its own Redis key prefix."""

    def __init__(self, up_args: list[str], dtype: str, model: str | None = None, timeout_s: float = 300.0) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "pagedserve.services.cli", "up", "--port", str(port), "--dtype", dtype,
                "--prefix", f"bench-{uuid.uuid4().hex[:8]}", "--log-level", "warning",
                *(["--model", model] if model else []), *up_args]
        self.proc = subprocess.Popen(argv, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedserve up exited with {self.proc.returncode}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pagedserve up not ready in {timeout_s:.0f}s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run(args: argparse.Namespace) -> int:
    requests = load_workload(args.workload)
    if args.launch:
        stack = LaunchedStack(args.up_arg, args.dtype, args.model)  # the model the baseline runs too
        try:
            results = [measure(stack.base_url, requests, args, "pagedserve-stack", StackCpu(stack.proc.pid))]
        finally:
            stack.stop()
    else:
        url = (args.url or DEFAULT_URL).rstrip("/")
        results = [measure(url, requests, args, f"server@{url}")]
    if args.baseline == "inprocess":
        from pagedserve.services.bench.throughput import run_engine

        results.append(run_engine(requests, args))
    elif args.baseline == "hf":
        from pagedserve.services.bench.hf_baseline import run_hf_baseline

        results.append(run_hf_baseline(requests, args.model, args.dtype, args.hf_batch_size))
    for r in results:
        r["workload"], r["dtype"] = args.workload, args.dtype
    columns = ["system", "wall_s", "request_s", "output_tok_s", "total_tok_s"]
    columns += [f"{m}_{s}_ms" for m in ("ttft", "tpot", "itl", "e2e") for s in LATENCY_STATS]
    columns += ["peak_kv_usage", "prefix_hit_rate", "num_failed"]
    print_table(results, columns)
    cpu_columns = sorted({c for r in results for c in r if c.startswith("cpu_ms_per_step_")})
    if cpu_columns:
        print_table(results, ["system", "model", "steps", *cpu_columns])
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r.get("num_failed", 0) == 0 for r in results) else 1
