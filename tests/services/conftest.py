"""Real back-end processes on the real Redis, for end-to-end tests.

ServiceStack starts kvstore, worker and scheduler as subprocesses (`python -m
services.<svc>.main`) under a fresh key prefix, each logging to a file; it can kill -9 and
restart any of them, and removes every key of its prefix when closed. TestApi plays an api
process on the wire: its own api_id and heartbeat, SubmitRequest/AbortRequest on the
requests stream, DeltaBatches read from its deltas stream. Other e2e suites can import
both (`from tests.services.conftest import ServiceStack, TestApi`).

A failing test that uses any ServiceStack fixture gets the services' logs in its report.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest

from pagedserve.shared.codec import pack, unpack
from pagedserve.shared.messages import AbortRequest, DeltaBatch, SamplingParams, SubmitRequest
from pagedserve.shared.redis_connect import sync_client
from pagedserve.shared.streams import FIELD, Keys
from tests.waiting import stop_processes, wait_for  # noqa: F401  (wait_for re-exported to the tests)

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
MODULES = {"kvstore": "pagedserve.services.kvstore.main", "worker": "pagedserve.services.gpu_worker.main",
           "scheduler": "pagedserve.services.scheduler.main"}
DEFAULT_ARGS = {"kvstore": [], "worker": ["--dtype", "float32", "--num-blocks", "256", "--worker-id", "0"],
                "scheduler": []}
START_TIMEOUT_S = 180.0


def delete_prefix(prefix: str, redis_url: str = REDIS_URL) -> None:
    """Remove every key of a test's prefix."""
    r = sync_client(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


class ServiceStack:
    def __init__(self, log_dir: Path, prefix: str | None = None, redis_url: str = REDIS_URL,
                 args: dict[str, list[str]] | None = None) -> None:
        self.keys = Keys(prefix or f"test-{uuid.uuid4().hex[:12]}")
        self.redis_url, self.log_dir = redis_url, log_dir
        self.redis = sync_client(redis_url)  # plain or redis+sentinel://
        self.args = {**DEFAULT_ARGS, **(args or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_paths: list[Path] = []

    @staticmethod
    def heartbeat_name(service: str) -> str:
        return "worker:0" if service == "worker" else service

    def incarnation(self, service: str) -> str | None:
        value = self.redis.get(self.keys.heartbeat(self.heartbeat_name(service)))
        return value.decode() if value is not None else None

    def start(self, service: str, wait: bool = True) -> subprocess.Popen:
        """Start one service; with wait, return once it heartbeats a new incarnation."""
        before = self.incarnation(service)
        log_path = self.log_dir / f"{service}-{len(self.log_paths)}.log"
        self.log_paths.append(log_path)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_CHECK_INTEGRITY": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", MODULES[service], "--redis-url", self.redis_url,
               "--prefix", self.keys.prefix, *self.args[service]]
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.procs[service] = proc
        if wait:
            self.wait_started(service, before)
        return proc

    def wait_started(self, service: str, before: str | None = None) -> str:
        proc = self.procs[service]

        def started():
            if proc.poll() is not None:
                raise RuntimeError(f"{service} exited with {proc.returncode} while starting:\n{self.logs()}")
            now = self.incarnation(service)
            return now if now not in (None, before) else None

        return wait_for(started, START_TIMEOUT_S, f"{service} to heartbeat")

    def kill(self, service: str, sig: int = signal.SIGKILL) -> int:
        proc = self.procs.pop(service)
        proc.send_signal(sig)
        return proc.wait(timeout=60)

    def stats(self, service: str) -> dict | None:
        data = self.redis.get(self.keys.stats(service))
        return msgpack.unpackb(data, raw=False) if data is not None else None

    def wait_kvstore_clean(self, timeout: float = 30.0, since: dict | None = None) -> dict:
        """The kvstore's stats once no block is held and its integrity check passes. With since
        (its stats read before a request was sent; prefix caching on), only stats of the live
        kvstore that has admitted a request since: it writes them a moment after each step, so
        the stats read just after a request finished may be from before it was admitted.
        since={} (no stats yet): any request admitted by the live kvstore."""
        live = self.incarnation("kvstore") if since is not None else None

        def clean():
            stats = self.stats("kvstore")
            if not stats or stats["num_held_blocks"] != 0 or not stats["integrity_ok"]:
                return None
            if since is not None and (stats["incarnation"] != live or stats["prefix_cache_queries"] <= (
                    since.get("prefix_cache_queries", 0) if since.get("incarnation") == live else 0)):
                return None
            return stats

        return wait_for(clean, timeout, f"kvstore to hold no block (last stats: {self.stats('kvstore')})")

    def logs(self, tail: int = 60) -> str:
        parts = []
        for path in self.log_paths:
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            parts.append(f"--- {path.name} (last {tail} lines) ---\n" + "\n".join(lines[-tail:]))
        return "\n".join(parts)

    def close(self) -> None:
        stop_processes(list(self.procs.values()), 20)
        self.procs.clear()
        delete_prefix(self.keys.prefix, self.redis_url)
        self.redis.close()


@dataclass
class Output:
    submit: SubmitRequest
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class TestApi:
    """An api process as the scheduler sees it (not a pytest class)."""

    __test__ = False

    def __init__(self, stack: ServiceStack, api_id: str | None = None, heartbeat_ttl_ms: int = 600_000) -> None:
        self.stack, self.r, self.keys = stack, stack.redis, stack.keys
        self.api_id = api_id or f"api-{uuid.uuid4().hex[:8]}"
        self.r.set(self.keys.heartbeat(f"api:{self.api_id}"), "test", px=heartbeat_ttl_ms)
        self.stream = self.keys.api_deltas(self.api_id)
        self.r.xgroup_create(self.stream, "api", id="0", mkstream=True)
        self.outputs: dict[str, Output] = {}

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
        sub = SubmitRequest(request_id, self.api_id, list(prompt_token_ids), sampling, arrival_time=time.time())
        self.outputs[request_id] = Output(sub)
        self.r.xadd(self.keys.requests, {FIELD: pack(sub)})
        return request_id

    def abort(self, request_id: str) -> None:
        self.r.xadd(self.keys.requests, {FIELD: pack(AbortRequest(request_id))})

    def resubmit_unfinished(self) -> list[str]:
        """What an api does when the scheduler's incarnation changes."""
        ids = []
        for request_id, out in self.outputs.items():
            if out.finish_reason is None:
                sub = out.submit
                again = SubmitRequest(request_id, self.api_id, sub.prompt_token_ids, sub.sampling,
                                      sub.arrival_time, output_token_ids=list(out.token_ids))
                self.r.xadd(self.keys.requests, {FIELD: pack(again)})
                ids.append(request_id)
        return ids

    def poll(self, block_ms: int = 100) -> int:
        """Apply the DeltaBatches waiting on this api's stream; how many were read."""
        reply = self.r.xreadgroup("api", self.api_id, {self.stream: ">"}, count=100, block=block_ms)
        n = 0
        for _stream, items in reply or []:
            for _entry_id, fields in items:
                n += 1
                for delta in unpack(fields[FIELD], DeltaBatch).deltas:
                    out = self.outputs.get(delta.request_id)
                    if out is None or out.finish_reason is not None:
                        continue
                    out.token_ids.extend(delta.new_token_ids)
                    out.finish_reason = delta.finish_reason
        return n

    def wait(self, condition, timeout: float, what: str):
        def step():
            self.poll()
            return condition()

        return wait_for(step, timeout, what, interval=0)

    def wait_finished(self, request_ids: list[str], timeout: float = 120.0) -> list[Output]:
        self.wait(lambda: all(self.outputs[r].finish_reason for r in request_ids), timeout,
                  f"requests {request_ids} to finish")
        return [self.outputs[r] for r in request_ids]

    def drain(self) -> None:
        while self.poll(block_ms=None):
            pass

    def close(self) -> None:
        self.r.delete(self.keys.heartbeat(f"api:{self.api_id}"))


def start_backend(log_dir: Path, **kwargs) -> ServiceStack:
    """kvstore, worker and scheduler started together (in any order they must find each
    other), returned once all three heartbeat."""
    stack = ServiceStack(log_dir, **kwargs)
    try:
        for service in ("scheduler", "kvstore", "worker"):
            stack.start(service, wait=False)
        for service in ("scheduler", "kvstore", "worker"):
            stack.wait_started(service)
    except BaseException:
        stack.close()
        raise
    return stack


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, ServiceStack):
                report.sections.append(("service logs", value.logs()))
