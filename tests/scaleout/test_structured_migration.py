"""kill -9 of a worker under 16 constrained requests (`pagedserve up --workers 2`): the requests
the dead worker held move to the other one, whose matchers are rebuilt by replaying the tokens
generated so far; every output still validates against its schema and, seeded, equals the
fault-free run's token for token."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.cli.helpers import wait_for
from tests.structured.schemas import SCHEMAS, check_json

pytestmark = pytest.mark.slow
NUM_REQUESTS = 16


@pytest.fixture
def stack(two_workers):
    return two_workers


def _run_all(stack) -> list[dict]:
    def one(i: int) -> dict:
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.post("/v1/chat/completions", json={
            "model": "smollm2", "temperature": 1.0, "seed": 1000 + i, "max_tokens": 160,
            "messages": [{"role": "user", "content": f"Answer {i} as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    # a client of its own per run: a kept-alive connection the server closed while idle is never reused
    with httpx.Client(base_url=stack.base, timeout=600.0) as client, ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(one, range(NUM_REQUESTS)))


def test_kill_9_of_a_worker_under_constrained_requests(stack):
    stack.wait_joined()  # ready may come with one worker joined: every request would go to it
    reference = _run_all(stack)
    pids = stack.worker_pids()
    start_tokens = stack.stats("scheduler")["generation_tokens_total"]
    with stack.anchored(), ThreadPoolExecutor(1) as pool:
        future = pool.submit(_run_all, stack)

        def both_busy():
            stats = stack.stats("scheduler")
            workers = stats.get("workers", {})
            busy = [w for w, s in workers.items() if s["num_requests_running"] > 0]
            return len(busy) == 2 and stats["generation_tokens_total"] >= start_tokens + 16 and workers

        workers = wait_for(both_busy, 300, "both workers to be generating constrained output")
        victim = sorted(pids)[0]
        kills = stack.kills(victim)
        os.kill(pids[victim], signal.SIGKILL)
        choices = future.result(timeout=900)
    assert stack.kills(victim) == kills + 1
    for i, choice in enumerate(choices):
        assert choice["finish_reason"] == "stop", choice
        check_json(choice["message"]["content"], SCHEMAS[i % len(SCHEMAS)])
    assert [c["message"]["content"] for c in choices] == [c["message"]["content"] for c in reference]
    assert all(json.loads(c["message"]["content"]) is not None for c in reference)
    stack.wait_swapped(next(w for w in workers if w.endswith(f"-{pids[victim]}")))
