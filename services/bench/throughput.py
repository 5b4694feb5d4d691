"""`pagedserve bench throughput`: the in-process engine offline on a workload, optionally
against HF transformers' static batching in the same run.

All requests at the start; TTFT and ITL from the step that emits each token.
--compare-prefix-caching runs with and without prefix caching (prompt_tokens_computed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields

from pagedserve.services.bench.report import latency_summary, print_table, throughput_fields
from pagedserve.services.bench.workloads import load_workload
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams
from pagedserve.shared.options import add_options
from pagedserve.shared.scheduler_config import StepLimits, add_policy_arguments

COLUMNS = ["system", "wall_s", "request_s", "output_tok_s", "total_tok_s", "ttft_p50_ms", "ttft_p99_ms",
           "itl_p50_ms", "itl_p99_ms", "num_preemptions", "prefix_hit_rate", "prompt_tokens_computed", "same_tokens"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=EngineConfig.device, help="the in-process engine's: cpu, cuda or cuda:N")
    parser.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                        help="on a GPU: the fraction of free memory the KV pool takes")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="the KV pool's storage")
    add_options(parser, StepLimits)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compare-prefix-caching", action="store_true",
                        help="run the engine with prefix caching on, then off, in this one run")
    parser.add_argument("--compare-speculation", action="store_true",
                        help="in-process: run with --speculative-config, then without, in this one run, and check "
                             "that the greedy tokens are the same (same_tokens)")
    add_policy_arguments(parser, parse_options=True)


def run_engine(requests, args, enable_prefix_caching: bool | None = None, speculative: str | None = None,
               outputs: dict[str, list[int]] | None = None) -> dict:
    """One in-process run; outputs (given): each request's tokens by request id."""
    from tqdm import tqdm

    from pagedserve.services.engine import Engine

    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
                          kv_cache_dtype=args.kv_cache_dtype,
                          **{f.name: getattr(args, f.name) for f in fields(StepLimits)},
                          enable_prefix_caching=args.enable_prefix_caching if enable_prefix_caching is None
                          else enable_prefix_caching, policy=args.policy, policy_options=args.policy_options,
                          speculative_config=speculative)
    engine = Engine(config)
    # warm-up outside the clock: one tiny request
    engine.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    num_steps = 0
    num_computed_before = engine.scheduler.stats().num_computed_prompt_tokens_total
    started = time.perf_counter()
    last_token_at: dict[str, float] = {}
    ttft, itl = [], []
    for r in requests:
        request_id = engine.add_request(r.prompt_token_ids,
                                        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=r.ignore_eos))
        last_token_at[request_id] = started
    num_output = 0
    with tqdm(total=sum(r.max_tokens for r in requests), unit="tok", desc="pagedserve", leave=False) as bar:
        while engine.has_unfinished_requests():
            deltas = engine.step()
            now = time.perf_counter()
            for d in deltas:
                if not d.new_token_ids:
                    continue
                (itl if d.num_output_tokens > len(d.new_token_ids) else ttft).append(now - last_token_at[d.request_id])
                last_token_at[d.request_id] = now
                if outputs is not None:
                    outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            new = sum(len(d.new_token_ids) for d in deltas)
            num_output += new
            bar.update(new)
            num_steps += 1
    wall = time.perf_counter() - started
    stats = engine.block_manager.stats()
    # the warm-up's few prompt tokens are not this run's: count from after it
    num_computed = engine.scheduler.stats().num_computed_prompt_tokens_total - num_computed_before
    caching = engine.config.enable_prefix_caching
    name = "pagedserve-inprocess" if enable_prefix_caching is None else \
        f"pagedserve-inprocess (prefix caching {'on' if caching else 'off'})"
    result = {"system": name, "num_steps": num_steps, "prefix_caching": caching, "policy": config.policy,
              "prompt_tokens_computed": num_computed,
              **throughput_fields(wall, len(requests), num_output, sum(len(r.prompt_token_ids) for r in requests)),
              **latency_summary("ttft", ttft), **latency_summary("itl", itl),
              "num_preemptions": stats.get("num_preemptions", 0),
              "prefix_hit_rate": stats.get("prefix_cache_hits", 0) / max(1, stats.get("prefix_cache_queries", 0))}
    if speculative:
        from pagedserve.shared.speculative_config import parse_speculative_config

        result["system"] += f" ({parse_speculative_config(speculative).method} speculation)"
        result["speculative_config"] = speculative
        result.update(engine.scheduler.spec_decode_totals())
    return result


def run(args: argparse.Namespace) -> int:
    from pagedserve.services.scheduler.policies.registry import configured_policy
    from pagedserve.shared.config import ConfigError

    try:
        configured_policy(args.policy, args.policy_options)  # a bad name fails now, naming the field
        from pagedserve.shared.speculative_config import parse_speculative_config

        parse_speculative_config(args.speculative_config)
    except ConfigError as e:
        print(f"bad config: {e}", file=sys.stderr)
        return 2
    requests = load_workload(args.workload)
    if args.compare_speculation:
        if not args.speculative_config:
            print("bad config: --compare-speculation needs --speculative-config", file=sys.stderr)
            return 2
        with_spec, without = {}, {}
        results = [run_engine(requests, args, speculative=args.speculative_config, outputs=with_spec),
                   run_engine(requests, args, outputs=without)]
        results[0]["same_tokens"] = with_spec == without
    elif args.compare_prefix_caching:
        results = [run_engine(requests, args, True), run_engine(requests, args, False)]
    else:
        results = [run_engine(requests, args, speculative=args.speculative_config)]
    if args.baseline == "hf":
        from tqdm import tqdm

        from pagedserve.services.bench.hf_baseline import run_hf_baseline

        with tqdm(total=len(requests), unit="req", desc="hf", leave=False) as bar:
            results.append(run_hf_baseline(requests, args.model, args.dtype, args.hf_batch_size, bar.update))
    for r in results:
        r["workload"] = args.workload
        r["dtype"] = args.dtype
        r["device"] = args.device
    print_table(results, COLUMNS)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0
