"""Every service on a host of its own: Redis, the kvstore, the scheduler, two workers and the
api each in its own network namespace (tests/faults/netns.py: own address, own loopback, own
/tmp), so none can reach another through 127.0.0.1, a shared /tmp or a unix socket. The
stack serves greedy requests; then worker 1's link goes down while it runs requests, and
every request still completes with the text of the fault-free run (they move to worker 2),
and the kvstore holds no block once idle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
import uuid

import httpx
import msgpack
import pytest
import redis

from pagedserve.shared.streams import Keys
from tests.faults import netns
from tests.faults.test_restarts import run_clients, submit
from tests.waiting import stop_process, wait_for

pytestmark = pytest.mark.slow
WHY_NOT = netns.available()
REQUESTS = 8
ANCHOR = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
HOSTS = ("redis", "kvstore", "scheduler", "worker1", "worker2", "api")


class SeparateStack:
    def __init__(self, tmp_path) -> None:
        self.tmp_path, self.procs = tmp_path, {}
        self.hosts = netns.Hosts()
        self.addr = {name: self.hosts.add(name) for name in HOSTS}
        self.keys = Keys(f"hosts-{uuid.uuid4().hex[:8]}")
        self.redis_url = f"redis://{self.addr['redis']}:6379/0"
        self.base_url = f"http://{self.addr['api']}:8000"

    def spawn(self, host: str, command: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_CHECK_INTEGRITY": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        with open(self.tmp_path / f"{host}.log", "w") as log:
            self.procs[host] = subprocess.Popen(self.hosts.argv(host, command), env=env, stdout=log,
                                                stderr=subprocess.STDOUT)

    def service(self, host: str, module: str, *extra: str) -> None:
        self.spawn(host, [sys.executable, "-m", f"pagedserve.services.{module}.main", "--redis-url", self.redis_url,
                          "--prefix", self.keys.prefix, *extra])

    def start(self) -> None:
        self.spawn("redis", ["redis-server", "--bind", self.addr["redis"], "--port", "6379", "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"])
        self.redis = redis.Redis.from_url(self.redis_url, socket_timeout=5)
        wait_for(self._pings, 30, "redis on its own host")
        self.service("kvstore", "kvstore")
        self.service("scheduler", "scheduler")
        for worker in ("worker1", "worker2"):
            self.service(worker, "gpu_worker", "--worker-id", worker, "--dtype", "float32", "--num-blocks", "256",
                         "--threads", "1")
        self.service("api", "api", "--host", self.addr["api"], "--port", "8000", "--api-id", "hosts-api")
        wait_for(self._both_workers_ready, 300, "/ready and both workers' heartbeats")

    def _pings(self) -> bool:
        assert self.procs["redis"].poll() is None, "redis-server exited:\n" + self.logs(["redis"])
        try:
            return self.redis.ping()
        except redis.RedisError:
            return False

    def _both_workers_ready(self) -> bool:
        dead = [h for h, p in self.procs.items() if p.poll() is not None]
        assert not dead, f"{dead} exited:\n" + self.logs(dead)
        try:
            ready = httpx.get(self.base_url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
        return ready and all(self.redis.exists(self.keys.heartbeat(f"worker:{w}")) for w in ("worker1", "worker2"))

    def stats(self, service: str) -> dict:
        data = self.redis.get(self.keys.stats(service))
        return msgpack.unpackb(data, raw=False) if data is not None else {}

    def logs(self, hosts) -> str:
        return "\n".join(f"--- {h} ---\n" + "\n".join((self.tmp_path / f"{h}.log").read_text().splitlines()[-30:])
                         for h in hosts)

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                stop_process(proc, 20)
        self.hosts.close()


@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_services_on_separate_hosts_serve_and_survive_a_worker_link_down(tmp_path):
    stack = SeparateStack(tmp_path)
    try:
        stack.start()
        api = types.SimpleNamespace(base_url=stack.base_url)
        baseline = run_clients(api, count=REQUESTS)
        assert all(finish in ("length", "stop") and text for text, finish in baseline), baseline
        at_cut: dict[str, float] = {}

        anchors: list[str] = []  # run until deleted: worker 1 is mid-generation at the cut however fast it is

        def cut_worker1():
            def busy():  # another anchor each second until one runs on worker 1 (placement goes by load)
                running = stack.stats("scheduler").get("workers", {}).get("worker1", {}).get("num_requests_running", 0)
                if not running and time.monotonic() >= at_cut.get("next", 0):
                    anchors.append(submit(stack.base_url, {**ANCHOR, "prompt": f"Anchor {len(anchors)}: count on"}))
                    at_cut["next"] = time.monotonic() + 1
                return running

            at_cut["running"] = wait_for(busy, 120, "worker 1 to run requests", interval=0.02)
            stack.hosts.link("worker1", up=False)
            at_cut["t"] = time.monotonic()

        results = run_clients(api, count=REQUESTS, during=cut_worker1)
        for request_id in anchors:
            assert httpx.delete(f"{stack.base_url}/v1/requests/{request_id}", timeout=30).status_code == 200
        print(f"\nworker 1 cut off running {at_cut['running']} of {REQUESTS} requests: "
              f"{sum(r != b for r, b in zip(results, baseline, strict=True))} lost, "
              f"all done {time.monotonic() - at_cut['t']:.1f} s after the cut")
        assert results == baseline
        assert at_cut["running"] > 0
        wait_for(lambda: "worker1" not in stack.stats("scheduler").get("workers", {"worker1": 1}), 60,
                 "the scheduler to drop the unreachable worker")
        kv = wait_for(lambda: (s := stack.stats("kvstore")).get("num_held_blocks") == 0 and s.get("integrity_ok")
                      and s, 60, "the kvstore to hold no block")
        assert kv["worker_ids"] == ["worker2"]
    finally:
        stack.close()
