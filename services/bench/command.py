"""`pagedserve bench KIND ...`: one subcommand per benchmark, each in its own module here."""

from __future__ import annotations

import argparse

from pagedserve.services.bench import codec, control_plane, fairness, latency, profile, sampler, serve, throughput
from pagedserve.services.bench.named_workloads import WORKLOADS


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="random-64",
                        help=f"{', '.join(WORKLOADS)} or FILE.json")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bfloat16 where the CPU computes it natively (AVX-512 BF16/AMX) or on a GPU, "
                             "else float32")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    throughput.add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="KIND")
    p = kinds.add_parser("throughput", help="the in-process engine, offline")
    _common(p)
    p.add_argument("--baseline", choices=["hf"], default=None, help="hf: HF transformers static batching")
    p = kinds.add_parser("serve", help="a server over HTTP (--url, or --launch the stack)")
    _common(p)
    p.add_argument("--baseline", choices=["hf", "inprocess"], default=None,
                   help="run after the server: hf (transformers static batching) or inprocess (the engine)")
    serve.add_arguments(p)
    p = kinds.add_parser("latency", help="one request alone, in-process or over HTTP")
    _common(p)
    serve.add_arguments(p)
    latency.add_arguments(p)
    p = kinds.add_parser("attention", help="paged vs dense attention micro-benchmark")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeat", type=int, default=20)
    fairness.add_arguments(kinds.add_parser("fairness", help="tenant A floods, B trickles: B's TTFT per policy"))
    p = kinds.add_parser("profile", help="where an in-process step's time goes (torch.profiler)")
    _common(p)
    profile.add_arguments(p)
    codec.add_arguments(kinds.add_parser("codec", help="pack + unpack of one step's messages"))
    sampler.add_arguments(kinds.add_parser("sampler", help="the sampler's cost per step, greedy and random rows"))
    control_plane.add_arguments(kinds.add_parser(
        "control-plane", help="scheduler, kvstore and Redis against many simulated workers"))


def run(args: argparse.Namespace) -> int:
    if args.kind == "attention":
        from pagedserve.services.bench import attention as bench_attention

        bench_attention.main(["--repeat", str(args.repeat)] + (["--threads", str(args.threads)] if args.threads else []))
        return 0
    if args.kind in ("fairness", "codec", "sampler", "control-plane"):
        return {"fairness": fairness, "codec": codec, "sampler": sampler, "control-plane": control_plane}[args.kind].run(args)
    if args.dtype == "auto":  # resolved once, so every system of the run uses the same one
        from pagedserve.services.gpu_worker.device import resolve_device, resolve_dtype

        args.dtype = str(resolve_dtype("auto", resolve_device(args.device))).removeprefix("torch.")
    return {"throughput": throughput, "serve": serve, "latency": latency, "profile": profile}[args.kind].run(args)
