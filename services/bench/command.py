"""`pagedserve bench throughput|serve ...`: the options both kinds share, then dispatch.

throughput: the in-process engine, offline (services/bench/throughput.py).
serve: a running server over HTTP, or one it launches (services/bench/serve.py).
"""

from __future__ import annotations

import argparse

from services.bench import latency, serve, throughput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["throughput", "serve", "latency", "attention"],
                        help="throughput: the in-process engine, offline; serve: a server over HTTP; "
                             "latency: one request alone; attention: paged vs dense attention micro-benchmark")
    parser.add_argument("--workload", default="random-64",
                        help="random-64, shared-prefix-32, decode-heavy-128 or FILE.json")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bfloat16 where the CPU computes it natively (AVX-512 BF16/AMX), else float32")
    parser.add_argument("--baseline", choices=["hf", "inprocess"], default=None,
                        help="hf: HF transformers static batching; inprocess (serve only): the in-process engine")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    throughput.add_arguments(parser)
    serve.add_arguments(parser)
    latency.add_arguments(parser)
    parser.add_argument("--threads", type=int, default=None, help="attention: torch threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    if args.kind == "throughput" and args.baseline == "inprocess":
        raise SystemExit("pagedserve bench throughput: --baseline inprocess is for `bench serve`")
    if args.kind == "attention":
        from services.gpu_worker.attention import bench_attention

        bench_attention.main(["--repeat", str(args.repeat)] + (["--threads", str(args.threads)] if args.threads else []))
        return 0
    if args.dtype == "auto":  # resolved once, so every system of the run uses the same one
        from services.gpu_worker.device import cpu_has_bf16

        args.dtype = "bfloat16" if cpu_has_bf16() else "float32"
    return {"throughput": throughput, "serve": serve, "latency": latency}[args.kind].run(args)
