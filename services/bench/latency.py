"""`pagedserve bench latency`: one request alone, the latency a single user sees.

    pagedserve bench latency [--prompt-len 256] [--output-len 128] [--repeat 5]
    pagedserve bench latency --url http://127.0.0.1:8000     (or --launch: through the stack)

A lone random prompt, greedy with ignore_eos, --repeat times, each run prefilling in full (no
prefix cache in-process, a fresh prompt per server run). TTFT: submit -> first token; per-token:
mean later gap. Min (uncontended cost) and median over runs. --launch also gives each service's CPU
ms per token (one step a token), where a lone request's time through the stack goes.
In-process, --speculative-config applies; --draft-tokens 0,1,4 times a verification step of 1 + K
tokens (K drafts a step, forced and rejected, so each step still adds one token) against a plain one.
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
    parser.add_argument("--draft-tokens", default=None, metavar="K,...",
                        help="in-process: per-step cost with K forced (rejected) drafts a step, for each K")


def lone_requests(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    return [BenchRequest([rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.prompt_len)], args.output_len)
            for _ in range(args.repeat)]


def _inprocess(requests: list[BenchRequest], args: argparse.Namespace,
               draft_tokens: int = 0) -> list[tuple[float, float, float]]:
    """(ttft, per-token, per-step) of each run."""
    from pagedserve.services.engine import Engine
    from pagedserve.shared.config import EngineConfig
    from pagedserve.shared.messages import SamplingParams

    forced = {"method": "ngram", "num_speculative_tokens": draft_tokens} if draft_tokens else None
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 kv_cache_memory=args.kv_cache_memory,
                                 speculative_config=forced or args.speculative_config))
    if forced:  # a token no prompt holds at every draft position: verified, then rejected
        engine.scheduler._speculator._propose = lambda request, k: [0] * k if k >= 1 else []
    engine.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    runs = []
    for r in requests:
        started = time.perf_counter()
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
        times, counts = [], []
        while engine.has_unfinished_requests():
            new = sum(len(d.new_token_ids) for d in engine.step())
            if new:
                times.append(time.perf_counter())
                counts.append(new)
        gap = times[-1] - times[0]
        runs.append((times[0] - started, gap / max(1, sum(counts[1:])), gap / max(1, len(times) - 1)))
    return runs


def _over_http(base_url: str, requests: list[BenchRequest], args: argparse.Namespace,
               cpu: StackCpu | None = None) -> tuple[list[tuple[float, float]], dict]:
    """(ttft, per-token) of each run; cpu given: each service's CPU ms per step after the warm-up."""
    from pagedserve.services.bench.serve_client import run_load

    asyncio.run(run_load(base_url, served_model(args), [BenchRequest(requests[0].prompt_token_ids[:8], 2)],
                         math.inf, None, args.api_key))
    before = cpu.snapshot_after_a_step() if cpu is not None else None  # after a first step: step ids start at a random base
    runs = []
    for r in requests:  # one at a time: a lone user
        (record,), _wall = asyncio.run(run_load(base_url, served_model(args), [r], math.inf, 1, args.api_key))
        if not record.ok:
            raise RuntimeError(f"request failed: {record.error}")
        runs.append((record.ttft_s, record.tpot_s or math.nan, math.nan))
    if cpu is None:
        return runs, {}
    time.sleep(2 * SCRAPE_EVERY_S)  # the scheduler's stats blob catches up with the last step
    return runs, StackCpu.per_step(before, cpu.snapshot())  # one step a token: no drafts here


def _summary(system: str, runs: list[tuple[float, float, float]]) -> dict:
    summary = {"system": system, "runs": len(runs)}
    for i, name in enumerate(("ttft", "per_token", "per_step")):
        values = [run[i] for run in runs]
        summary[f"{name}_min_ms"], summary[f"{name}_median_ms"] = min(values) * 1e3, statistics.median(values) * 1e3
    return summary


def _draft_costs(requests: list[BenchRequest], args: argparse.Namespace) -> list[dict]:
    """One row per K: the step's cost, and its ratio to the plain step's (K = 0), by medians."""
    results = []
    for k in sorted({0, *(int(k) for k in args.draft_tokens.split(","))}):
        result = _summary(f"pagedserve-inprocess ({k} drafts a step)", _inprocess(requests, args, k))
        result["draft_tokens"] = k
        result["step_cost_x"] = result["per_step_median_ms"] / (results[0] if results else result)["per_step_median_ms"]
        results.append(result)
    return results


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
    elif args.draft_tokens:
        results = _draft_costs(requests, args)
    else:
        results = [_summary("pagedserve-inprocess", _inprocess(requests, args))]
    for r in results:
        r["prompt_len"], r["output_len"], r["dtype"] = args.prompt_len, args.output_len, args.dtype
    print_table(results, ["system", "runs", "ttft_min_ms", "ttft_median_ms", "per_token_min_ms",
                          "per_token_median_ms", "per_step_median_ms"] + (["step_cost_x"] if args.draft_tokens else []))
    cpu_columns = sorted({c for r in results for c in r if c.startswith("cpu_ms_per_step_")})
    if cpu_columns:  # where a token's CPU goes, by service: on few cores the others' share delays the worker
        print_table(results, ["system", "steps", *cpu_columns])
    if args.output:
        import json

        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0
