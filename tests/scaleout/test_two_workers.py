"""`pagedserve up --workers 2` end to end: real processes, the real Redis, the real model.

In file order, on one stack (`two_workers`, shared with test_structured_migration: loading two
workers takes a while):
(a) sequential requests sharing long prefixes, interleaved, find their prefix cached every
time after the first (prefix routing sends each back to the worker that holds it);
(b) 32 concurrent distinct requests are spread: each worker produces >= 25% of the tokens
(per-worker Prometheus series);
(c) kill -9 of one worker under 16 concurrent greedy requests: all 16 complete with the
text of a fault-free run, and once idle no KV block is held and every pool passes its
integrity check. Float32, so a greedy text does not depend on which batch computed it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.shared.streams import Keys
from tests.cli.helpers import REDIS_URL, START_TIMEOUT_S, base_env, free_port, pagedserve_argv, wait_for
from tests.services.conftest import delete_prefix
from tests.waiting import stop_process

pytestmark = pytest.mark.slow

SYSTEM = {name: " ".join(f"Rule {i} of the {name} desk: answer question {i} briefly and politely." for i in range(40))
          for name in ("billing", "travel", "weather")}


class Stack:
    def __init__(self, tmp_path) -> None:
        self.prefix = f"test-{uuid.uuid4().hex[:12]}"
        self.keys = Keys(self.prefix)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "up.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        argv = [*pagedserve_argv(), "up", "--workers", "2", "--dtype", "float32", "--num-blocks", "512",
                "--port", str(self.port), "--prefix", self.prefix, "--ready-timeout", str(START_TIMEOUT_S)]
        env = base_env(REDIS_URL=REDIS_URL, PAGEDSERVE_CHECK_INTEGRITY="1")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.redis = redis.Redis.from_url(REDIS_URL)
        wait_for(lambda: self._ready(), START_TIMEOUT_S + 30, "pagedserve up --workers 2 to be ready")
        self.client = httpx.Client(base_url=self.base, timeout=300.0)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"pagedserve up exited with {self.proc.returncode}:\n{self.text()[-4000:]}")
        return "pagedserve ready at" in self.text()

    def worker_pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"started (worker\d) \(pid (\d+)\)", self.text())}

    def stats(self, service: str) -> dict:
        data = self.redis.get(self.keys.stats(service))
        return msgpack.unpackb(data, raw=False) if data is not None else {}

    def per_worker(self, name: str) -> dict[str, float]:
        """The samples of a Prometheus family by live worker id (not "departed": the killed workers' counts)."""
        families = text_string_to_metric_families(self.client.get("/metrics").text)
        family = next(f for f in families if f.name == name)
        return {s.labels["worker"]: s.value for s in family.samples if s.labels.get("worker", "departed") != "departed"}

    def complete(self, prompt: str, max_tokens: int, **extra) -> dict:
        r = self.client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def wait_joined(self) -> None:
        def joined():
            scheduler, kvstore = self.stats("scheduler").get("workers", {}), self.stats("kvstore").get("worker_ids", [])
            return len(scheduler) == 2 and set(scheduler) == set(kvstore)

        wait_for(joined, START_TIMEOUT_S, "both workers in the scheduler's and the kvstore's stats")

    @contextlib.contextmanager
    def anchored(self):
        """Two requests that run until aborted (the router puts them on both workers): a kill that
        waits for both workers to be busy finds them so however fast the machine."""
        body = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
        ids = []
        try:
            for i in range(2):  # the second placed once the first runs: its worker is the loaded one
                ids.append(self.client.post("/v1/requests", json={"prompt": f"Anchor {i} counts: 1, 2,", **body})
                           .json()["request_id"])
                wait_for(lambda: self.client.get(f"/v1/requests/{ids[-1]}").json()["status"] == "running", 120,
                         f"anchor {i} to run")
            yield ids
        finally:
            for request_id in ids:
                self.client.delete(f"/v1/requests/{request_id}")

    def kills(self, worker: str) -> int:
        """How many times up has seen the worker killed and restarted it."""
        return self.text().count(f"{worker} exited with -9: restarting it in")

    def wait_swapped(self, dead_id: str) -> dict:
        """The kvstore's stats once the dead worker is dropped, its restart (a new id) in and no block held."""
        def clean():
            kv = self.stats("kvstore")
            ids = kv.get("worker_ids", [])
            return kv if kv.get("num_held_blocks") == 0 and kv.get("integrity_ok") and len(ids) == 2 \
                and dead_id not in ids else None

        return wait_for(clean, 120, f"the kvstore to swap the dead worker for its restart ({self.stats('kvstore')})")

    def close(self) -> None:
        self.client.close()
        stop_process(self.proc, 60, signal.SIGINT)
        self.log.close()
        self.redis.close()
        delete_prefix(self.prefix)


@pytest.fixture
def stack(two_workers):
    return two_workers


def test_both_workers_join(stack):
    stack.wait_joined()
    assert len(stack.worker_pids()) == 2


def test_sequential_requests_find_their_long_prefix_cached_every_time_after_the_first(stack):
    cached: dict[str, list[int]] = {name: [] for name in SYSTEM}
    for round_ in range(3):
        for name, system in SYSTEM.items():
            body = stack.complete(f"{system}\nQuestion {round_} for {name}:", 2)
            assert body["usage"]["prompt_tokens"] >= 400
            cached[name].append((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    for name, hits in cached.items():
        assert hits[0] == 0, (name, hits)  # nothing of it was cached anywhere
        assert all(hit >= 400 for hit in hits[1:]), (name, hits)  # the whole system prompt, each time


def test_concurrent_distinct_requests_are_spread_over_both_workers(stack):
    before = stack.per_worker("pagedserve:generation_tokens")
    prompts = [f"Request {i}: name a color and an animal, number {i * 37 % 101}." for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        bodies = list(pool.map(lambda p: stack.complete(p, 8, ignore_eos=True), prompts))
    assert all(b["usage"]["completion_tokens"] == 8 for b in bodies)

    def counted():
        after = stack.per_worker("pagedserve:generation_tokens")
        produced = {w: after[w] - before.get(w, 0.0) for w in after}
        return produced if sum(produced.values()) >= 32 * 8 else None

    produced = wait_for(counted, 30, "the per-worker token counters to reach 256")
    assert len(produced) == 2
    assert all(n >= 0.25 * sum(produced.values()) for n in produced.values()), produced


def test_kill_9_of_a_worker_moves_its_requests_with_identical_greedy_text(stack):
    prompts = [f"Tell a short story number {i} about a {['cat', 'dog', 'fox', 'owl'][i % 4]}." for i in range(16)]

    def run_all() -> list[str]:
        with ThreadPoolExecutor(16) as pool:
            return [b["choices"][0]["text"] for b in pool.map(lambda p: stack.complete(p, 40, ignore_eos=True), prompts)]

    reference = run_all()
    pids = stack.worker_pids()
    start_tokens = stack.stats("scheduler")["generation_tokens_total"]
    with stack.anchored(), ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_all)

        def both_busy():  # mid-generation: both workers hold requests that have produced tokens
            stats = stack.stats("scheduler")
            workers = stats.get("workers", {})
            busy = [w for w, s in workers.items() if s["num_requests_running"] > 0]
            return len(busy) == 2 and stats["generation_tokens_total"] >= start_tokens + 16 and workers

        workers = wait_for(both_busy, 120, "both workers to be generating")
        running = {w: s["num_requests_running"] for w, s in workers.items()}
        victim = sorted(pids)[0]
        kills = stack.kills(victim)
        os.kill(pids[victim], signal.SIGKILL)
        texts = future.result(timeout=300)
    assert texts == reference
    assert stack.kills(victim) == kills + 1
    assert stack.proc.poll() is None  # the stack serves on, and up restarts the dead worker
    assert all(n > 0 for n in running.values())
    kv = stack.wait_swapped(next(w for w in workers if w.endswith(f"-{pids[victim]}")))
    assert kv["num_blocks"] == 1024  # the survivor's pool and the restarted worker's
    assert sorted(stack.stats("scheduler")["workers"]) == sorted(kv["worker_ids"])
