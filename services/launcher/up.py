"""`pagedserve up`: the whole stack on one machine, each service a child in its own process group.

Ready when the api's /ready is 200; a child that dies before (or no readiness in time) stops the
rest and exits 1 with its last log lines. Once ready, a child that dies is restarted with backoff,
and one that keeps crashing stops the rest the same way; the embedded Redis, if any, stops last.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import fields

import httpx

from pagedserve.services.gpu_worker.startup import last_phase
from pagedserve.services.launcher.api_replicas import api_replicas, port_taken
from pagedserve.services.launcher.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from pagedserve.services.launcher.redis_warmup import start_warm_redis
from pagedserve.services.launcher.restart_policy import RESTART_CAP_S, RESTART_FIRST_S, WINDOW_S, RestartPolicy
from pagedserve.services.launcher.restart_stats import RestartStats
from pagedserve.services.launcher.supervisor import Child, Supervisor
from pagedserve.shared.config import (
    DEFAULT_KV_OFFLOAD_MEMORY,
    KV_CACHE_DTYPES,
    ConfigError,
    kv_offload_bytes,
    parse_size,
)
from pagedserve.shared.options import add_options, command_line, from_args
from pagedserve.shared.scheduler_config import SchedulerConfig, add_policy_arguments
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.up")

PROGRESS_EVERY_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="model name or path (default: smollm2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 on a GPU or a CPU with AVX-512 BF16/AMX, else float32")
    parser.add_argument("--device", default=None, help="worker device, e.g. cpu or cuda (default: the worker's)")
    parser.add_argument("--host", default="127.0.0.1", help="api address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="api port (default 8000)")
    parser.add_argument("--api-replicas", type=int, default=1,
                        help="api processes serving the port together (SO_REUSEPORT; default 1)")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV pool budget on a CPU (default 2GiB)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV pool storage: auto (the model's dtype) or int8 (about half the bytes per block)")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    parser.add_argument("--kv-offload-memory", default=DEFAULT_KV_OFFLOAD_MEMORY,
                        help=f"offload tier shared by every worker, in Redis (0: off; default {DEFAULT_KV_OFFLOAD_MEMORY})")
    parser.add_argument("--workers", type=int, default=1,
                        help="workers to start (data parallel: each its own model copy and KV pool; default 1)")
    parser.add_argument("--threads-per-worker", type=int, default=None,
                        help="CPU threads of each worker (default: the cores split between the workers, at least 1)")
    parser.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_true", default=True,
                        help="share cached prefix blocks between requests (default)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="no prefix sharing (to compare)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (env PAGEDSERVE_API_KEY)")
    parser.add_argument("--prefix", default=os.environ.get("PAGEDSERVE_PREFIX") or "pagedserve",
                        help="Redis key prefix (env PAGEDSERVE_PREFIX)")
    parser.add_argument("--log-level", default=os.environ.get("PAGEDSERVE_LOG_LEVEL") or "info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for /ready (default 180)")
    parser.add_argument("--restart-delay", type=float, default=RESTART_FIRST_S,
                        help=f"seconds before restarting a dead child, doubled for each death within "
                             f"{WINDOW_S:.0f} s up to {RESTART_CAP_S:.0f} s (default {RESTART_FIRST_S})")
    add_policy_arguments(parser)
    for name, what in (("--max-prompt-tokens", "prompt tokens"), ("--max-output-tokens", "max_tokens")):
        parser.add_argument(name, type=int, default=None, help=f"per-request limit on {what} (400 past it)")
    add_options(parser, SchedulerConfig, defaults=False)  # passed on to the scheduler when given


def check_args(args: argparse.Namespace) -> None:
    """ConfigError naming the option for a bad value, before anything starts."""
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port={args.port}: must be in 1..65535")
    parse_size(args.kv_cache_memory)
    kv_offload_bytes(getattr(args, "kv_offload_memory", "0"))
    if args.num_blocks is not None and args.num_blocks < 1:
        raise ConfigError(f"--num-blocks={args.num_blocks}: must be at least 1")
    if not args.prefix or any(c.isspace() for c in args.prefix):
        raise ConfigError(f"--prefix={args.prefix!r}: must be non-empty without spaces")
    if args.ready_timeout <= 0:
        raise ConfigError(f"--ready-timeout={args.ready_timeout}: must be > 0")
    if not 0 < args.restart_delay <= RESTART_CAP_S:
        raise ConfigError(f"--restart-delay={args.restart_delay}: must be in (0, {RESTART_CAP_S}]")
    if getattr(args, "api_replicas", 1) < 1:
        raise ConfigError(f"--api-replicas={args.api_replicas}: must be at least 1")
    for option in ("workers", "threads_per_worker"):
        if getattr(args, option, None) is not None and getattr(args, option) < 1:
            raise ConfigError(f"--{option.replace('_', '-')}={getattr(args, option)}: must be at least 1")
    from_args(SchedulerConfig, args)
    for option in ("max_prompt_tokens", "max_output_tokens"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise ConfigError(f"--{option.replace('_', '-')}={getattr(args, option)}: must be at least 1")
    from pagedserve.services.scheduler.main import load_policy

    load_policy(args.policy, args.policy_options)  # not installed, or bad options: fail before starting
    from pagedserve.shared.speculative_config import parse_speculative_config

    parse_speculative_config(getattr(args, "speculative_config", None))
    from pagedserve.shared.model_source import resolve_model

    try:
        resolve_model(args.model)
    except ValueError as e:
        raise ConfigError(f"--model={args.model!r}: {e}") from None


def service_commands(args: argparse.Namespace, redis_url: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of each service, in start order."""
    common = ["--redis-url", redis_url, "--prefix", args.prefix, "--log-level", args.log_level]
    kvstore = [] if args.prefix_caching else ["--no-prefix-caching"]
    kvstore += ["--kv-offload-memory", str(getattr(args, "kv_offload_memory", DEFAULT_KV_OFFLOAD_MEMORY))]
    worker = ["--model", args.model, "--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
              "--kv-cache-dtype", args.kv_cache_dtype]
    if args.num_blocks is not None:
        worker += ["--num-blocks", str(args.num_blocks)]
    if args.device:
        worker += ["--device", args.device]
    api = ["--model", args.model, "--host", args.host, "--port", str(args.port)]
    given = [f.name for f in fields(SchedulerConfig) if getattr(args, f.name, None) is not None]
    scheduler = ["--policy", args.policy, "--policy-options", args.policy_options,
                 *command_line(from_args(SchedulerConfig, args), given)]
    for option, extra in (("max_prompt_tokens", api), ("max_output_tokens", api), ("speculative_config", scheduler)):
        if getattr(args, option, None) is not None:
            extra += [f"--{option.replace('_', '-')}", str(getattr(args, option))]

    def cmd(module: str, extra: list[str]) -> list[str]:
        return [sys.executable, "-m", f"pagedserve.services.{module}.main", *common, *extra]

    num_workers = getattr(args, "workers", 1)
    threads = worker_threads(num_workers, getattr(args, "threads_per_worker", None))
    if threads is not None:
        worker += ["--threads", str(threads)]
    workers = [("worker" if num_workers == 1 else f"worker{i}", cmd("gpu_worker", worker)) for i in range(num_workers)]
    return [("kvstore", cmd("kvstore", kvstore)), ("scheduler", cmd("scheduler", scheduler)), *workers,
            *api_replicas(cmd("api", api), getattr(args, "api_replicas", 1), args.host, args.port)]


def worker_threads(num_workers: int, threads_per_worker: int | None) -> int | None:
    """Each worker's CPU threads: as asked, else the cores split (>= 1); None for a lone worker."""
    if threads_per_worker is not None or num_workers == 1:
        return threads_per_worker
    return max(1, len(os.sched_getaffinity(0)) // num_workers)


def child_env(redis_url: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, REDIS_URL=redis_url, PAGEDSERVE_PREFIX=args.prefix, PYTHONUNBUFFERED="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.api_key:
        env["PAGEDSERVE_API_KEY"] = args.api_key  # the api reads it; kept off the command line
    return env


def probe_url(host: str, port: int) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def wait_ready(sup: Supervisor, base_url: str, timeout_s: float, stop: threading.Event) -> str | None:
    """None once /ready is 200; else why not (a child died, timeout, interrupted)."""
    start = time.monotonic()
    next_progress = start + PROGRESS_EVERY_S
    missing, said = "api", ""
    with httpx.Client(timeout=2.0) as client:
        while not stop.is_set():
            dead = sup.first_dead()
            if dead is not None:
                return f"{dead.name} exited with {dead.returncode()} before the stack was ready"
            try:
                r = client.get(base_url + "/ready")
                if r.status_code == 200:
                    return None
                missing = ", ".join(r.json().get("missing", [])) or f"HTTP {r.status_code}"
            except (httpx.HTTPError, ValueError):
                missing = "api"
            now = time.monotonic()
            if now - start > timeout_s:
                return f"not ready after {timeout_s:.0f} s (waiting for: {missing})"
            doing = workers_doing(sup)
            if now >= next_progress or (doing and doing != said):  # at once when a worker's phase changes
                log.info("waiting for the stack (%.0f s): %s not ready yet%s", now - start, missing,
                         f"; {doing}" if doing else "")
                next_progress, said = now + PROGRESS_EVERY_S, doing
            stop.wait(0.5)
    return "interrupted"


def workers_doing(sup: Supervisor) -> str:
    """'worker: <its latest startup phase>' for each worker that has logged one, '; '-joined."""
    doing = ((c.name, last_phase(c.tail(40))) for c in sup.children if c.name.startswith("worker"))
    return "; ".join(f"{name}: {phase}" for name, phase in doing if phase)


def report_failure(sup: Supervisor, why: str, dead: Child | None = None) -> None:
    log.error("pagedserve up failed: %s", why)
    dead = dead or sup.first_dead()
    suspects = [dead] if dead is not None else [c for c in sup.children if c.name != "redis"]
    for child in suspects:
        lines = child.tail(20)
        print(f"--- last log lines of {child.name} ---", file=sys.stderr)
        print("\n".join(lines) if lines else "(no output)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per /ready probe
    try:
        check_args(args)
    except ConfigError as e:
        print(f"pagedserve up: invalid config: {e}", file=sys.stderr)
        return 2
    taken = port_taken(args.host, args.port)
    if taken is not None:  # before anything starts: nothing is left behind
        print(f"pagedserve up: {taken}", file=sys.stderr)
        return 3
    stop, force = threading.Event(), threading.Event()

    def on_signal(signum, _frame) -> None:
        if stop.is_set():
            force.set()
        log.info("got %s: stopping", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor(policy=lambda: RestartPolicy(first_s=args.restart_delay))
    embedded: EmbeddedRedis | None = None
    try:
        redis_url = os.environ.get("REDIS_URL")
        if redis_url:
            log.info("using redis at %s (REDIS_URL)", redis_url)
        else:
            embedded = EmbeddedRedis(sup)
            redis_url = embedded.prepare()
        env, services = child_env(redis_url, args), service_commands(args, redis_url)
        for name, argv in services:  # a worker needs Redis only once loaded: it imports torch meanwhile
            if name.startswith("worker"):
                sup.start(Child(name, argv, env))
        if embedded is not None:
            embedded.start()
            start_warm_redis(embedded.url, kv_offload_bytes(getattr(args, "kv_offload_memory", "0")), stop,
                             Keys(args.prefix).requests)
        return _run(args, sup, stop, redis_url, [s for s in services if not s[0].startswith("worker")], env)
    except EmbeddedRedisError as e:
        log.error("%s", e)
        return 1
    finally:
        sup.stop_all(grace_s=15.0, force=force, last=embedded.child if embedded else None)
        if embedded is not None:
            embedded.cleanup()
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.info("pagedserve up stopped")


def _run(args: argparse.Namespace, sup: Supervisor, stop: threading.Event, redis_url: str,
         services: list[tuple[str, list[str]]], env: dict[str, str]) -> int:
    if stop.is_set():
        return 0
    for name, argv in services:
        sup.start(Child(name, argv, env))
    base_url = probe_url(args.host, args.port)
    why = wait_ready(sup, base_url, args.ready_timeout, stop)
    if why == "interrupted":
        return 0
    if why is not None:
        report_failure(sup, why)
        return 1
    wildcard = " (listening on every interface)" if args.host in ("0.0.0.0", "", "::") else ""
    print(f"pagedserve ready at {base_url}{wildcard}", flush=True)
    print(f"  dashboard {base_url}/dashboard, API docs {base_url}/docs, metrics {base_url}/metrics", flush=True)
    sup.publish = RestartStats(redis_url, args.prefix)  # restarts counted in the api's /metrics
    while not stop.wait(0.5):
        crashing = sup.heal()  # a dead child is restarted; its requests go on (they recompute)
        if crashing is not None:
            report_failure(sup, f"{crashing.name} keeps crashing (last exit {crashing.returncode()})", crashing)
            return 1
    return 0
