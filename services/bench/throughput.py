"""`pagedserve bench throughput`: the in-process engine offline on a workload, optionally
against HF transformers' static batching in the same run."""

from __future__ import annotations

import argparse
import json
import time

from services.bench.workloads import load_workload
from shared.config import EngineConfig
from shared.messages import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="random-64", help="random-64, shared-prefix-32, decode-heavy-128 or FILE.json")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--baseline", choices=["hf"], default=None)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--output", default=None, help="write the results as JSON here")


def run_engine(requests, args) -> dict:
    from tqdm import tqdm

    from services.engine import Engine

    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=args.enable_prefix_caching)
    engine = Engine(config)
    # warm-up outside the clock: one tiny request
    engine.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    num_steps = 0
    num_output = 0
    started = time.perf_counter()
    for r in requests:
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True))
    total = sum(r.max_tokens for r in requests)
    with tqdm(total=total, unit="tok", desc="pagedserve", leave=False) as bar:
        while engine.has_unfinished_requests():
            deltas = engine.step()
            new = sum(len(d.new_token_ids) for d in deltas)
            num_output += new
            bar.update(new)
            num_steps += 1
    wall = time.perf_counter() - started
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    stats = engine.block_manager.stats()
    return {"system": "pagedserve-inprocess", "wall_s": wall, "num_requests": len(requests), "num_steps": num_steps,
            "output_tokens": num_output, "prompt_tokens": num_prompt, "output_tok_s": num_output / wall,
            "total_tok_s": (num_output + num_prompt) / wall, "request_s": len(requests) / wall,
            "num_preemptions": stats.get("num_preemptions", 0),
            "prefix_cache_hit_rate": stats.get("prefix_cache_hits", 0) / max(1, stats.get("prefix_cache_queries", 0))}


def print_table(results: list[dict]) -> None:
    cols = ["system", "wall_s", "output_tok_s", "total_tok_s", "request_s"]
    print(" | ".join(f"{c:>28}" if i == 0 else f"{c:>12}" for i, c in enumerate(cols)))
    for r in results:
        print(" | ".join(f"{r[c]:>28}" if i == 0 else f"{r[c]:>12.2f}" for i, c in enumerate(cols)))
    if len(results) == 2:
        print(f"pagedserve / {results[1]['system']}: output tok/s x{results[0]['output_tok_s'] / results[1]['output_tok_s']:.2f}")


def run(args: argparse.Namespace) -> int:
    requests = load_workload(args.workload)
    results = [run_engine(requests, args)]
    if args.baseline == "hf":
        from tqdm import tqdm

        from services.bench.hf_baseline import run_hf_baseline

        with tqdm(total=len(requests), unit="req", desc="hf", leave=False) as bar:
            results.append(run_hf_baseline(requests, args.model, args.dtype, args.hf_batch_size, bar.update))
    for r in results:
        r["workload"] = args.workload
        r["dtype"] = args.dtype
    print_table(results)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0
