"""`pagedserve up` heals: kill -9 of the scheduler, the kvstore, the worker or the api under
REQUESTS in-flight greedy requests, and nobody restarts anything by hand. Every client
(REST submit, SSE follow resumed with Last-Event-ID) gets the text of a fault-free run, up
restarts the child after its backoff and counts it in /metrics, the kvstore holds 0 blocks
once idle, and the time from the kill until the new process serves is printed (its heartbeat;
the api: /ready).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import types
import uuid

import httpx
import msgpack
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.shared.streams import Keys
from tests.cli.helpers import REDIS_URL, START_TIMEOUT_S, base_env, free_port, pagedserve_argv
from tests.faults.test_restarts import run_clients
from tests.services.conftest import delete_prefix
from tests.waiting import stop_process, wait_for

pytestmark = pytest.mark.slow
REQUESTS = 8  # four faults, each a fault-free-length run; test_restarts covers 24 per fault


class Up:
    """`pagedserve up` on the local Redis under a fresh prefix, its output in a file."""

    def __init__(self, tmp_path) -> None:
        self.prefix = f"heal-{uuid.uuid4().hex[:10]}"
        self.keys = Keys(self.prefix)
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = tmp_path / "up.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        argv = [*pagedserve_argv(), "up", "--dtype", "float32", "--num-blocks", "256", "--port", str(port),
                "--prefix", self.prefix, "--ready-timeout", str(START_TIMEOUT_S), "--restart-delay", "0.05"]
        self.proc = subprocess.Popen(argv, env=base_env(REDIS_URL=REDIS_URL, PAGEDSERVE_CHECK_INTEGRITY="1"),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.redis = redis.Redis.from_url(REDIS_URL)
        wait_for(lambda: self._alive() and "pagedserve ready at" in self.text(), START_TIMEOUT_S + 30, "up ready")

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"pagedserve up exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
        return True

    def pid(self, name: str) -> int:
        """The pid of the child's latest start."""
        return int(re.findall(rf"started {name} \(pid (\d+)\)", self.text())[-1])

    def ready(self) -> bool:
        try:
            return httpx.get(self.base_url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def restarts(self) -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(self.base_url + "/metrics", timeout=10).text)
        family = next(f for f in families if f.name == "pagedserve:service_restarts")
        return {s.labels["service"]: s.value for s in family.samples}

    def kvstore_clean(self) -> dict | None:
        data = self.redis.get(self.keys.stats("kvstore"))
        stats = msgpack.unpackb(data, raw=False) if data is not None else {}
        return stats if stats.get("num_held_blocks") == 0 and stats.get("integrity_ok") else None

    def close(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc, timeout=60, sig=signal.SIGINT)
        self.log.close()
        self.redis.close()
        delete_prefix(self.prefix)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    stack = Up(tmp_path_factory.mktemp("heal"))
    try:
        stack.baseline = run_clients(stack, count=REQUESTS)
        assert all(finish in ("length", "stop") and text for text, finish in stack.baseline), stack.baseline
        yield stack
    finally:
        stack.close()


@pytest.mark.parametrize("service", ["scheduler", "kvstore", "worker", "api"])
def test_kill_9_under_up_loses_nothing(up, service):
    before = up.restarts().get(service, 0)
    outage: dict[str, float] = {}

    def fault():
        pid, before = up.pid(service), up.redis.get(up.keys.heartbeat(service))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        new_pid = wait_for(lambda: up._alive() and up.pid(service) != pid and up.pid(service), 60, "a restart")

        def serving() -> bool:  # the new process itself, not a heartbeat the dead one left
            if service == "api":
                return up.ready()
            if service == "worker":
                return bool(up.redis.exists(up.keys.heartbeat(f"worker:{socket.gethostname()}-{new_pid}")))
            return up.redis.get(up.keys.heartbeat(service)) not in (None, before)

        wait_for(serving, 240, f"the restarted {service} to serve", interval=0.05)
        outage["s"] = time.monotonic() - killed_at

    results = run_clients(types.SimpleNamespace(base_url=up.base_url), count=REQUESTS, during=fault)
    lost = sum(r != b for r, b in zip(results, up.baseline, strict=True))
    print(f"\nkill -9 {service} under {REQUESTS} requests: {lost} lost, serving again after {outage['s']:.2f} s")
    assert lost == 0, [(r, b) for r, b in zip(results, up.baseline, strict=True) if r != b][:3]
    assert re.search(rf"{service} exited with -9: restarting it in", up.text())
    assert up.restarts()[service] == before + 1
    wait_for(up.kvstore_clean, 60, "the kvstore to hold no block")
    assert up.proc.poll() is None


def test_a_child_that_keeps_crashing_stops_up_with_its_last_lines(up):
    """Last in this file: it ends the stack. The worker killed each time it comes back: past
    5 deaths within 120 s up gives up, names it with its last log lines and exits 1."""
    for _ in range(10):
        if up.proc.poll() is not None:
            break
        pid = up.pid("worker")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda pid=pid: up.proc.poll() is not None or up.pid("worker") != pid, 120, "a restart or up's end")
    assert up.proc.wait(timeout=60) == 1
    text = up.text()
    assert re.search(r"worker keeps crashing \(exit -9, 6 deaths within 120 s\): giving up", text), text[-3000:]
    assert "pagedserve up failed: worker keeps crashing (last exit -9)" in text
    assert "--- last log lines of worker ---" in text
