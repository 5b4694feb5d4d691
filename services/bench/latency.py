"""`pagedserve bench latency`: one request alone, the latency a single user sees.

    pagedserve bench latency [--prompt-len 256] [--output-len 128] [--repeat 5]
    pagedserve bench latency --url http://127.0.0.1:8000     (or --launch: through the stack)

A lone random prompt, greedy with ignore_eos, --repeat times, each run prefilling in full (no
prefix cache in-process, a fresh prompt per server run). TTFT: submit -> first token; per-token:
mean later gap. Min (uncontended cost) and median over runs. --launch also gives each service's CPU
ms per token (one step a token), where a lone request's time through the stack goes.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time

from pagedserve.services.bench.report import print_table
from pagedserve.services.bench.serve import SCRAPE_EVERY_S, LaunchedStack, served_model
from pagedserve.services.bench.stack_cpu import StackCpu
from pagedserve.services.bench.workloads import BenchRequest

VOCAB_LO, VOCAB_HI = 100, 49152 - 100  # SmolLM2 ids, clear of special tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)


def lone_requests(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    return [BenchRequest([rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.prompt_len)], args.output_len)
            for _ in range(args.repeat)]


def _inprocess(requests: list[BenchRequest], args: argparse.Namespace) -> list[tuple[float, float]]:
    from pagedserve.services.engine import Engine
    from pagedserve.shared.config import EngineConfig
    from pagedserve.shared.messages import SamplingParams

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 kv_cache_memory=args.kv_cache_memory))
    engine.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    runs = []
    for r in requests:
        started = time.perf_counter()
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        times = []
        while engine.has_unfinished_requests():
            if any(d.new_token_ids for d in engine.step()):
                times.append(time.perf_counter())
        runs.append((times[0] - started, (times[-1] - times[0]) / max(1, len(times) - 1)))
    return runs


def _over_http(base_url: str, requests: list[BenchRequest], args: argparse.Namespace,
               cpu: StackCpu | None = None) -> tuple[list[tuple[float, float]], dict]:
    """(ttft, per-token) of each run; cpu given: each service's CPU ms per step after the warm-up."""
    from pagedserve.services.bench.serve_client import run_load

    asyncio.run(run_load(base_url, served_model(args), [BenchRequest(requests[0].prompt_token_ids[:8], 2)],
                         math.inf, None, args.api_key))
    before = cpu.snapshot() if cpu is not None else None  # after a first step: step ids start at a random base
    runs = []
    for r in requests:  # one at a time: a lone user
        (record,), _wall = asyncio.run(run_load(base_url, served_model(args), [r], math.inf, 1, args.api_key))
        if not record.ok:
            raise RuntimeError(f"request failed: {record.error}")
        runs.append((record.ttft_s, record.tpot_s or math.nan))
    if cpu is None:
        return runs, {}
    time.sleep(2 * SCRAPE_EVERY_S)  # the scheduler's stats blob catches up with the last step
    return runs, StackCpu.per_step(before, cpu.snapshot())  # one step a token: no drafts here


def _summary(system: str, runs: list[tuple[float, float]]) -> dict:
    ttft = [t for t, _ in runs]
    per_token = [p for _, p in runs]
    return {"system": system, "runs": len(runs), "ttft_min_ms": min(ttft) * 1e3,
            "ttft_median_ms": statistics.median(ttft) * 1e3, "per_token_min_ms": min(per_token) * 1e3,
            "per_token_median_ms": statistics.median(per_token) * 1e3}


def run(args: argparse.Namespace) -> int:
    requests = lone_requests(args)
    if args.launch:
        stack = LaunchedStack(args.up_arg, args.dtype, args.model)
        try:
            runs, cpu = _over_http(stack.base_url, requests, args, StackCpu(stack.proc.pid))
            results = [_summary("pagedserve-stack", runs) | cpu]
        finally:
            stack.stop()
    elif args.url is not None:
        url = args.url.rstrip("/")
        results = [_summary(f"server@{url}", _over_http(url, requests, args)[0])]
    else:
        results = [_summary("pagedserve-inprocess", _inprocess(requests, args))]
    for r in results:
        r["prompt_len"], r["output_len"], r["dtype"] = args.prompt_len, args.output_len, args.dtype
    print_table(results, ["system", "runs", "ttft_min_ms", "ttft_median_ms", "per_token_min_ms",
                          "per_token_median_ms"])
    cpu_columns = sorted({c for r in results for c in r if c.startswith("cpu_ms_per_step_")})
    if cpu_columns:  # where a token's CPU goes, by service: on few cores the others' share delays the worker
        print_table(results, ["system", "steps", *cpu_columns])
    if args.output:
        import json

        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0
