"""Policies, admission and stop strings through the real stack (api, scheduler, kvstore,
worker processes on the real Redis; scheduler: 2 running at most, 8 waiting at most; api:
per-request limits). Greedy texts are compared with the same stack's own answers to the
same requests sent one at a time.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.conftest import ApiProcess
from tests.services.conftest import start_backend, wait_for

pytestmark = pytest.mark.slow

MAX_WAITING = 8
PROMPTS = [f"Write one sentence about the number {i}." for i in range(6)]
LONG = {"max_tokens": 60, "ignore_eos": True, "temperature": 0}  # runs for a while: the queue fills
# runs until deleted: no running request finishes (and lets a waiting one in) mid-test
UNENDING = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    stack = start_backend(tmp_path_factory.mktemp("stack"), args={
        "scheduler": ["--max-num-seqs", "2", "--max-waiting-requests", str(MAX_WAITING)]})
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def api(backend, tmp_path_factory):
    process = ApiProcess(tmp_path_factory.mktemp("api"), backend.keys.prefix,
                         args=["--max-prompt-tokens", "200", "--max-output-tokens", "64"])
    try:
        process.wait_ready()
        yield process
    finally:
        process.close()


@pytest.fixture
def client(api, backend):
    with api.client(timeout=300) as c:
        yield c
    _wait_idle(backend)


@pytest.fixture
def unlimited_client(backend, tmp_path_factory):
    """A second api on the same stack without per-request limits, so requests can run
    long enough that none finishes (and lets a waiting one in) while a test looks."""
    process = ApiProcess(tmp_path_factory.mktemp("api"), backend.keys.prefix)
    try:
        process.wait_healthy()
        with process.client(timeout=300) as c:
            yield c
    finally:
        process.close()
    _wait_idle(backend)


def _wait_idle(backend) -> None:
    backend.wait_kvstore_clean(timeout=120)
    wait_for(lambda: (backend.stats("scheduler") or {}).get("num_requests_running", 1) == 0
             and backend.stats("scheduler").get("num_requests_waiting", 1) == 0, 120, "the scheduler to be idle")


def _complete(client, prompt: str, **fields) -> dict:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _set_policy(client, name: str, options: dict | None = None) -> httpx.Response:
    return client.post("/admin/policy", json={"name": name, "options": options or {}})


def test_admin_policy_reports_swaps_and_refuses_what_is_not_installed(client):
    assert client.get("/admin/policy").json() == {"policy": {"name": "fcfs", "options": {}}}
    response = _set_policy(client, "sjf", {"aging": 2})
    assert response.status_code == 200 and response.json() == {"policy": {"name": "sjf", "options": {"aging": 2.0}}}
    wait_for(lambda: client.get("/admin/policy").json()["policy"]["name"] == "sjf", 30, "the stats to show sjf")
    refused = _set_policy(client, "no-such-policy")
    assert refused.status_code == 400 and "no-such-policy" in refused.json()["error"]["message"]
    assert _set_policy(client, "sjf", {"speed": 1}).status_code == 400
    assert client.post("/admin/policy", json={"options": {}}).status_code == 400
    assert _set_policy(client, "fcfs").status_code == 200


def test_a_hot_swap_under_load_completes_every_request_exactly(client, backend):
    alone = [_complete(client, prompt, ignore_eos=True)["text"] for prompt in PROMPTS]
    swaps = [("fair", {}), ("priority", {}), ("sjf", {"aging": 0.5}), ("fcfs", {})]
    generated = lambda: (backend.stats("scheduler") or {}).get("generation_tokens_total", 0)
    start, total = generated(), 12 * len(PROMPTS)  # ignore_eos: exactly 12 tokens each
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_complete, client, prompt, ignore_eos=True, user=f"tenant-{i % 2}", priority=i % 3)
                   for i, prompt in enumerate(PROMPTS)]
        # each swap at a fixed point of the whole work (2 running at a time, the rest waiting):
        # every point is reached, so however fast the stack runs no wait outlives the work
        for k, (name, options) in enumerate(swaps, start=1):
            point = start + total * k // (len(swaps) + 1)
            wait_for(lambda p=point: generated() >= p, 120, f"{point - start} of {total} tokens before a swap")
            assert _set_policy(client, name, options).status_code == 200
        choices = [f.result() for f in futures]
    assert [c["text"] for c in choices] == alone
    assert [c["finish_reason"] for c in choices] == ["length"] * len(PROMPTS)


def test_per_request_limits_answer_400_naming_the_limit(client):
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 65})
    assert response.status_code == 400 and "max_output_tokens=64" in response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"prompt": "word " * 300, "max_tokens": 4})
    assert response.status_code == 400 and "max_prompt_tokens=200" in response.json()["error"]["message"]


def test_a_full_queue_answers_429_before_any_stream_and_fair_still_admits_another_tenant(unlimited_client, backend):
    client = unlimited_client
    accepted = []
    try:
        def flood() -> httpx.Response:
            response = client.post("/v1/requests", json={"prompt": "Tell me a long story.", "user": "flood", **UNENDING})
            if response.status_code == 202:
                accepted.append(response.json()["request_id"])
            return response

        refused = wait_for(lambda: (r := flood()).status_code == 429 and r, 120, "a 429")
        assert refused.headers["Retry-After"].isdigit() and refused.json()["error"]["code"] == "queue_full"
        assert len(accepted) >= MAX_WAITING  # 2 running + 8 waiting fit
        # fcfs: the queue is full for everyone, once the api's table (refreshed every 0.1 s)
        # shows what the scheduler sees; until then the api's own count may refuse a request
        # that a fresher table admits
        wait_for(lambda: backend.stats("scheduler").get("num_requests_waiting", 0) >= MAX_WAITING, 60,
                 "the scheduler to see a full queue")

        def stream_refusal():  # a stream admitted before the api's table caught up ends with its connection
            with client.stream("POST", "/v1/completions",
                               json={"prompt": "hi", "stream": True, "user": "flood", **UNENDING}) as r:
                return r.status_code == 429 and r.headers["content-type"]
        content_type = wait_for(stream_refusal, 10, "a 429 before a stream opens")
        assert content_type.startswith("application/json")

        def other_tenant() -> httpx.Response:
            response = client.post("/v1/requests", json={"prompt": "hi", "user": "other", **UNENDING})
            if response.status_code == 202:
                accepted.append(response.json()["request_id"])
            return response

        other = wait_for(lambda: (r := other_tenant()).status_code == 429 and r, 10, "a 429 for another tenant")
        assert other.headers["Retry-After"].isdigit()
        assert _set_policy(client, "fair").status_code == 200
        ok = wait_for(lambda: (r := client.post("/v1/requests", json={"prompt": "hi", "user": "other", **UNENDING}))
                      .status_code == 202 and r, 30, "fair to admit another tenant")
        accepted.append(ok.json()["request_id"])
        assert flood().status_code == 429  # the flooder is still over its share
    finally:
        for request_id in accepted:
            client.delete(f"/v1/requests/{request_id}")
        _set_policy(client, "fcfs")


def test_a_stop_string_spanning_tokens_is_cut_exactly_in_a_stream(client):
    full = _complete(client, PROMPTS[0], max_tokens=24)["text"]
    stop = full[len(full) // 2 - 2:len(full) // 2 + 2]  # 4 characters from the middle: likely over 2 tokens
    expected = full[:full.index(stop)]
    text, finish = "", None
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                                         "stream": True, "stop": [stop]}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert text == expected and finish == "stop"

