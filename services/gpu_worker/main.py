"""`pagedserve worker`: loads the model and KV pool before joining (failures are fatal at start), then runs loop.py."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import socket
import sys

from pagedserve.services.gpu_worker.startup import StartupPhases
from pagedserve.shared import redis_io
from pagedserve.shared.config import ConfigError, EngineConfig
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.worker")
TIER_WRITE_TIMEOUT_S = 30.0  # a tier write stuck past it fails (logged; readers compute those blocks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    redis_io.add_common_arguments(parser)
    parser.add_argument("--worker-id", default=None,
                        help="this worker's id (its plan stream, pool and heartbeat); default <hostname>-<pid>, "
                             "unique per process, so several workers (or `compose --scale`) never collide")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for this worker's torch/OpenMP (default: torch's, all cores); "
                             "`pagedserve up --workers N` splits the cores between its workers")
    parser.add_argument("--model", default="smollm2", help="model name, GGUF file or HF directory")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch, triton or reference")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV pool budget on CPU (e.g. 512MiB, 2GiB)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="KV pool storage: auto (the model's dtype) or int8")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                        help="fraction of free GPU memory for the KV pool")
    parser.add_argument("--num-blocks", type=int, default=None, help="pool size in blocks (overrides the budget)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)


def build_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                        attention_backend=args.attention_backend, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        num_blocks=args.num_blocks, max_model_len=args.max_model_len, seed=args.seed)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def check_worker_args(args: argparse.Namespace) -> None:
    """ConfigError naming the field; fills the default worker id."""
    if args.worker_id is None:
        args.worker_id = default_worker_id()
    if not args.worker_id or any(c.isspace() or c == ":" for c in args.worker_id):
        raise ConfigError(f"invalid config field 'worker_id'={args.worker_id!r}: non-empty, no spaces or ':'")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"invalid config field 'threads'={args.threads!r}: at least 1")


def _load_worker(config: EngineConfig, threads: int | None, phases: StartupPhases):
    with phases.phase("imports", "importing torch and the model code"):
        import torch

        from pagedserve.services.gpu_worker.worker import Worker

    if threads is not None:
        torch.set_num_threads(threads)  # on the compute thread: its OpenMP team is this size
    torch.manual_seed(config.seed)
    worker = Worker(config, phases)
    worker.start_prefault()  # the served worker waits for requests: its idle time faults the pool in
    return worker


def run(args: argparse.Namespace) -> int:
    try:
        redis_io.setup_logging(args.log_level)
        check_worker_args(args)
        config = build_config(args)
    except ConfigError as e:
        log.critical("bad config: %s", e)
        return 2
    log.info("worker %s starting: model=%s dtype=%s device=%s redis=%s prefix=%s", args.worker_id, config.model,
             config.dtype, config.device, args.redis_url, args.prefix)
    # every torch op runs on one thread: OpenMP gives each calling thread its own team, and two teams contend
    if args.threads is not None:  # before torch loads: OpenMP reads it once
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    phases = StartupPhases()
    compute = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    try:
        worker = compute.submit(_load_worker, config, args.threads, phases).result()
        max_model_len = worker.model_config.context_length(config.max_model_len or None)
    except Exception as e:  # a model that cannot load, a pool that does not fit, a context it lacks
        log.critical("worker %s cannot start: %s: %s", args.worker_id, type(e).__name__, e, exc_info=True)
        return 1
    from pagedserve.services.gpu_worker.loop import WorkerLoop
    from pagedserve.services.gpu_worker.tier_writer import writer_client

    redis_io.settle_gc()  # the model, torch and modules: full collections skip them

    phases.begin("joining the stack (heartbeat, hello to the scheduler)")

    return redis_io.run_loop(args.redis_url, "worker", lambda r: WorkerLoop(
        r, Keys(args.prefix), worker, args.worker_id, config.model, max_model_len, compute,
        writer_client(args.redis_url, TIER_WRITE_TIMEOUT_S)))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pagedserve worker")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
