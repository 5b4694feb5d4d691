"""`pagedserve bench throughput|serve ...`: the options both kinds share, then dispatch.

throughput: the in-process engine, offline (services/bench/throughput.py).
serve: a running server over HTTP, or one it launches (services/bench/serve.py).
"""

from __future__ import annotations

import argparse

from services.bench import serve, throughput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["throughput", "serve"],
                        help="throughput: the in-process engine, offline; serve: a server over HTTP")
    parser.add_argument("--workload", default="random-64",
                        help="random-64, shared-prefix-32, decode-heavy-128 or FILE.json")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--baseline", choices=["hf", "inprocess"], default=None,
                        help="hf: HF transformers static batching; inprocess (serve only): the in-process engine")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    throughput.add_arguments(parser)
    serve.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.kind == "throughput" and args.baseline == "inprocess":
        raise SystemExit("pagedserve bench throughput: --baseline inprocess is for `bench serve`")
    return (throughput if args.kind == "throughput" else serve).run(args)
