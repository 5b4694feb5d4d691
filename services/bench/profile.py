"""`pagedserve bench profile`: where an in-process step's time goes.

Skips --skip-steps steps, profiles --steps with torch.profiler, prints the top self-CPU items
per step. C++ kernel calls get record_function ranges (e.g. gemv.linear_q4); "unaccounted" is
Python between ops.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.services.bench.workloads import load_workload
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-steps", type=int, default=40, help="steps run before profiling (the prefill)")
    parser.add_argument("--steps", type=int, default=10, help="steps profiled")
    parser.add_argument("--top", type=int, default=20, help="rows printed")


class _Traced:
    """Forwards to a compiled module; each call is a profiler range named tag.function."""

    def __init__(self, module, tag: str) -> None:
        self._module, self._tag = module, tag

    def __getattr__(self, name: str):
        from torch.profiler import record_function

        function = getattr(self._module, name)

        def traced(*args):
            with record_function(f"{self._tag}.{name}"):
                return function(*args)
        return traced


def _trace_kernels(engine) -> None:
    model, backend = engine.worker.model, engine.worker.backend
    if model.fused is not None:
        model.fused = _Traced(model.fused, "fused")
        for layer in model.layers:
            layer.fused = model.fused
    for attribute in ("_kernel", "_prefill_kernel"):  # the decode and the prefill attention kernels
        if getattr(backend, attribute, None) is not None:
            setattr(backend, attribute, _Traced(getattr(backend, attribute), "kernel"))
    linears = [model.head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    for linear in linears:  # the few-row projections (cpu_gemv: gemv.linear, gemv.linear_q4)
        if linear.gemv is not None:
            linear.gemv = _Traced(linear.gemv, "gemv")


def profile_steps(engine, num_steps: int) -> tuple[float, list[dict]]:
    """(mean step seconds, rows {name, ms_per_step, calls_per_step}, most expensive first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        step_s = (time.perf_counter() - started) / num_steps
    rows = [{"name": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / num_steps,
             "calls_per_step": e.count / num_steps} for e in prof.key_averages()]
    rows.sort(key=lambda row: -row["ms_per_step"])
    return step_s, rows


def run(args: argparse.Namespace) -> int:
    from pagedserve.services.engine import Engine

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                                 kv_cache_dtype=args.kv_cache_dtype,
                                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                 enable_prefix_caching=args.enable_prefix_caching,
                                 num_scheduler_steps=1))  # a step is one forward pass here
    _trace_kernels(engine)
    for r in load_workload(args.workload):
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=r.ignore_eos))
    for _ in range(args.skip_steps):
        engine.step()
    num_running = engine.scheduler.num_running
    step_s, rows = profile_steps(engine, args.steps)
    accounted = sum(row["ms_per_step"] for row in rows)
    print(f"{args.workload}, {args.dtype}: steps {args.skip_steps}..{args.skip_steps + args.steps - 1}, "
          f"{num_running} running; {step_s * 1e3:.1f} ms per step, "
          f"{max(0.0, step_s * 1e3 - accounted):.1f} ms unaccounted")
    print(f"{'item':50s} {'ms/step':>9s} {'calls/step':>11s}")
    for row in rows[: args.top]:
        print(f"{row['name'][:50]:50s} {row['ms_per_step']:9.2f} {row['calls_per_step']:11.0f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"workload": args.workload, "dtype": args.dtype, "step_ms": step_s * 1e3,
                       "num_running": num_running, "rows": rows}, f, indent=2)
    return 0
