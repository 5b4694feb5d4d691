"""The fault suite: kill -9 and restart each process (api, scheduler, kvstore, worker) and
Redis itself, under NUM_REQUESTS in-flight greedy requests, on a Redis of its own.

Every client submits on REST and follows its record's SSE stream, resuming with
Last-Event-ID whenever the connection breaks (as a client of a restarted api does). Each
fault asserts exact counts: every request completes with the text of a fault-free run;
REST records submitted before an api restart answer "finished" with that text after it;
requests sent after a Redis restart are served; the kvstore holds 0 blocks once idle.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from tests.api.conftest import ApiProcess, free_port
from tests.services.conftest import ServiceStack, wait_for

pytestmark = pytest.mark.slow

NUM_REQUESTS = 24
MAX_TOKENS = 12  # small: 24 requests per fault on a 2-core machine
CLIENT_TIMEOUT_S = 240.0
API_ID = "fault-api"


class OwnRedis:
    """A redis-server of this suite's own (no persistence), killed and restarted on its port."""

    def __init__(self, log_dir) -> None:
        self.port, self.log_dir = free_port(), log_dir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=open(self.log_dir / "redis.log", "a"),
                                     stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url)

        def up():
            try:
                return client.ping()
            except redis.ConnectionError:
                return False

        wait_for(up, 20, "redis-server to answer")
        client.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


def _body(i: int) -> dict:
    return {"prompt": f"Here is fact number {i} about the sea:", "max_tokens": MAX_TOKENS, "temperature": 0.0}


def submit(base_url: str, body: dict) -> str:
    def accepted():
        try:
            r = httpx.post(base_url + "/v1/requests", json=body, timeout=30)
        except httpx.HTTPError:
            return None
        return r.json()["request_id"] if r.status_code == 202 else None

    return wait_for(accepted, 120, "the api to accept a request", interval=0.2)


def follow(base_url: str, request_id: str) -> tuple[str, str | None]:
    """The request's text and finish reason, read from its SSE stream, resumed from the last
    event id across broken connections (an api or Redis restart)."""
    text, finish, cursor = "", None, 0
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while finish is None and time.monotonic() < deadline:
        try:
            with httpx.stream("GET", f"{base_url}/v1/requests/{request_id}/stream",
                              headers={"Last-Event-ID": str(cursor)}, timeout=httpx.Timeout(60, read=90)) as r:
                if r.status_code != 200:
                    time.sleep(0.3)
                    continue
                pending = 0
                for line in r.iter_lines():
                    if line.startswith("id: "):
                        pending = int(line[4:])
                    elif line.startswith("data: "):
                        msg = json.loads(line[6:])
                        if msg["type"] == "delta":
                            text += msg["text"]
                        elif msg["type"] == "final":
                            finish = msg["finish_reason"]
                    elif line == "" and pending:
                        cursor = pending
        except httpx.HTTPError:
            time.sleep(0.3)
    return text, finish


def run_clients(api: ApiProcess, count: int = NUM_REQUESTS, during=None) -> list[tuple[str, str | None]]:
    """`count` clients at once; `during()` runs once they are all submitted and one has tokens."""
    with ThreadPoolExecutor(count) as pool:
        ids = list(pool.map(lambda i: submit(api.base_url, _body(i)), range(count)))
        futures = [pool.submit(follow, api.base_url, request_id) for request_id in ids]
        if during is not None:
            wait_for(lambda: _started(api, ids), 120, "a request to have tokens")
            during()
        return [f.result() for f in futures]


def _started(api: ApiProcess, ids: list[str]) -> bool:
    """A request runs, or ran already (a fast back-end may finish one between two polls)."""
    try:
        return any(httpx.get(f"{api.base_url}/v1/requests/{i}", timeout=5).json().get("status") in (
            "running", "finished") for i in ids)
    except (httpx.HTTPError, ValueError):
        return False


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("faults")
    own = OwnRedis(log_dir)
    own.start()
    stack = ServiceStack(log_dir, prefix=f"fault-{uuid.uuid4().hex[:8]}", redis_url=own.url)
    world = {"stack": stack, "redis": own, "log_dir": log_dir}
    try:
        for service in ("scheduler", "kvstore", "worker"):
            stack.start(service, wait=False)
        for service in ("scheduler", "kvstore", "worker"):
            stack.wait_started(service)
        world["api"] = start_api(log_dir, stack, own)
        world["baseline"] = run_clients(world["api"])
        assert all(finish in ("length", "stop") and text for text, finish in world["baseline"]), world["baseline"]
        yield world
    finally:
        if "api" in world:
            world["api"].close()
        stack.close()
        own.close()


def start_api(log_dir, stack: ServiceStack, own: OwnRedis, port: int | None = None) -> ApiProcess:
    api = ApiProcess(log_dir, stack.keys.prefix, redis_url=own.url, port=port, args=["--api-id", API_ID])
    api.wait_ready()
    return api


def _assert_all_identical(results, baseline) -> None:
    same = sum(r == b for r, b in zip(results, baseline, strict=True))
    assert same == NUM_REQUESTS, [(r, b) for r, b in zip(results, baseline, strict=True) if r != b][:3]


@pytest.mark.parametrize("service", ["scheduler", "kvstore", "worker"])
def test_backend_kill_and_restart(world, service):
    stack = world["stack"]

    def fault():
        stack.kill(service)
        stack.start(service, wait=True)

    kv_before = stack.stats("kvstore") or {}
    _assert_all_identical(run_clients(world["api"], during=fault), world["baseline"])
    stack.wait_kvstore_clean(timeout=60, since=kv_before)


def test_api_kill_and_restart(world):
    old = world["api"]
    kv_before = world["stack"].stats("kvstore") or {}
    rest_ids = [submit(old.base_url, _body(i)) for i in range(6)]  # REST only: nobody follows them

    def fault():
        old.proc.kill()
        old.proc.wait()
        world["api"] = start_api(world["log_dir"], world["stack"], world["redis"], port=old.port)

    results = run_clients(old, during=fault)
    _assert_all_identical(results, world["baseline"])
    api = world["api"]
    records = [wait_for(lambda i=i: _finished(api, i), 60, f"record {i}") for i in rest_ids]
    assert sum(r["status"] == "finished" for r in records) == 6
    assert [(r["text"], r["finish_reason"]) for r in records] == world["baseline"][:6]
    world["stack"].wait_kvstore_clean(timeout=60, since=kv_before)


def _finished(api: ApiProcess, request_id: str) -> dict | None:
    body = httpx.get(f"{api.base_url}/v1/requests/{request_id}", timeout=10).json()
    return body if body.get("status") == "finished" else None


def test_redis_kill_and_restart(world):
    own, stack = world["redis"], world["stack"]

    def fault():
        own.kill()
        own.start()

    kv_before = stack.stats("kvstore") or {}
    _assert_all_identical(run_clients(world["api"], during=fault), world["baseline"])
    after = run_clients(world["api"], count=4)  # sent after the restart: served
    assert after == world["baseline"][:4]
    stack.redis = redis.Redis.from_url(own.url)
    stack.wait_kvstore_clean(timeout=60, since=kv_before)
