"""The api alone, in this process (tests/api/inprocess.py: uvicorn in a thread, the real
Redis, a back-end that heartbeats and holds every request queued): auth, every bad
input's 4xx, REST bookkeeping, readiness, metrics, and the abort a client that leaves sends.

Nothing ever runs, so every accepted request stays queued: what it sends on the requests
stream is the whole story, read back from the real Redis.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest
import websockets

from pagedserve.shared.messages import AbortRequest, SubmitRequest
from pagedserve.shared.streams import Keys
from tests.api.conftest import API_KEY, hanging_call
from tests.api.inprocess import Responder, ServedApi
from tests.api.test_inputs import BAD_BODIES
from tests.services.conftest import delete_prefix, wait_for

HTTP_BAD = BAD_BODIES


@pytest.fixture(scope="module")
def api_alone():
    prefix = f"test-edge-{uuid.uuid4().hex[:10]}"
    responder = Responder(Keys(prefix))
    responder._paused.set()  # nothing runs: every request stays queued
    with responder, ServedApi(prefix, api_key=API_KEY, max_body_bytes=65536) as api:
        yield api
    delete_prefix(prefix)


def _post(client: httpx.Client, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


def _ids(api, kind) -> list[str]:
    return [m.request_id for m in api.requests_stream() if isinstance(m, kind)]


def _wait_aborted(api, request_id: str) -> None:
    wait_for(lambda: request_id in _ids(api, AbortRequest), 30, f"an abort of {request_id}")


def test_open_routes_need_no_key_and_v1_routes_do(api_alone):
    with httpx.Client(base_url=api_alone.base_url) as anon:
        assert anon.get("/health").json()["status"] == "ok"
        assert anon.get("/metrics").status_code == 200
        assert anon.get("/ready").status_code == 200
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/requests/x"),
                             ("POST", "/v1/chat/completions")):
            r = anon.request(method, path, json={"prompt": "hi"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = anon.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    with api_alone.client() as c:
        models = c.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "smollm2"


def test_ready_names_what_is_missing():
    prefix = f"test-edge-{uuid.uuid4().hex[:10]}"
    with ServedApi(prefix) as api, api.client() as c:
        r = c.get("/ready")
    delete_prefix(prefix)
    assert r.status_code == 503 and set(r.json()["missing"]) == {"scheduler", "kvstore", "worker"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/requests"])
@pytest.mark.parametrize("body,status,code", HTTP_BAD, ids=[str(i) for i in range(len(HTTP_BAD))])
def test_bad_input_gets_its_4xx_and_submits_nothing(api_alone, path, body, status, code):
    if path == "/v1/completions" and isinstance(body, dict) and "messages" in body:
        path = "/v1/chat/completions"
    before = len(api_alone.requests_stream())
    with api_alone.client() as c:
        r = _post(c, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code
    assert len(api_alone.requests_stream()) == before


def test_echo_and_prompt_logprobs_only_on_the_openai_routes(api_alone):
    with api_alone.client() as c:
        for field, value in (("echo", True), ("prompt_logprobs", 1)):
            r = _post(c, "/v1/requests", {"prompt": "hi", field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_edge_errors_are_json(api_alone):
    with api_alone.client() as c:
        big = {"prompt": "x" * 70_000}
        r = _post(c, "/v1/completions", big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = c.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 40_000, b"x" * 40_000, b'"}']))
        assert r.status_code == 413  # chunked, no Content-Length: cut while reading
        assert c.get("/v1/nothing-here").status_code == 404
        assert c.get("/v1/completions").status_code == 405
        assert c.get("/v1/requests/no-such-id").status_code == 404
        assert c.delete("/v1/requests/no-such-id").status_code == 404
        assert c.get("/v1/requests/no-such-id/stream").status_code == 404


def test_rest_submit_poll_delete(api_alone):
    with api_alone.client() as c:
        r = _post(c, "/v1/requests", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 202
        request_id = r.json()["request_id"]
        state = c.get(f"/v1/requests/{request_id}").json()
        assert state["status"] == "queued" and state["token_ids"] == [] and state["finish_reason"] is None
        submitted = [m for m in api_alone.requests_stream() if isinstance(m, SubmitRequest)]
        assert [m.request_id for m in submitted] == [request_id]
        assert submitted[0].sampling.max_tokens == 4 and submitted[0].sampling.temperature == 1.0
        deleted = c.delete(f"/v1/requests/{request_id}").json()
        assert deleted["status"] == "aborted" and deleted["finish_reason"] == "abort"
        _wait_aborted(api_alone, request_id)
        assert c.get(f"/v1/requests/{request_id}").json()["status"] == "aborted"


def test_sse_client_that_drops_a_queued_request_aborts_it(api_alone):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True}
    with api_alone.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        request_id = wait_for(lambda: (_ids(api_alone, SubmitRequest) or [None])[-1], 30, "the submission")
    _wait_aborted(api_alone, request_id)


def test_non_streaming_client_that_hangs_up_aborts_its_request(api_alone):
    before = set(_ids(api_alone, SubmitRequest))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with hanging_call(api_alone, "/v1/chat/completions", body):  # hangs up once its request is submitted
        (request_id,) = wait_for(lambda: set(_ids(api_alone, SubmitRequest)) - before, 30, "the submission")
    _wait_aborted(api_alone, request_id)


def test_websocket_errors_and_close_abort(api_alone):
    url = api_alone.base_url.replace("http", "ws") + "/v1/stream"
    auth = {"Authorization": f"Bearer {API_KEY}"}

    async def scenario():
        async with websockets.connect(url) as ws:  # no key
            msg = json.loads(await ws.recv())
            assert msg["type"] == "error" and msg["status"] == 401
        async with websockets.connect(url, additional_headers=auth) as ws:
            await ws.send("{oops")
            msg = json.loads(await ws.recv())
            assert msg["type"] == "error" and msg["status"] == 400
        async with websockets.connect(url, additional_headers=auth) as ws:
            await ws.send(json.dumps({"prompt": "hi", "max_tokens": 0}))
            assert json.loads(await ws.recv())["status"] == 400
        before = set(_ids(api_alone, SubmitRequest))
        async with websockets.connect(url, additional_headers=auth) as ws:
            await ws.send(json.dumps({"prompt": "hi", "max_tokens": 4}))
            return wait_for(lambda: set(_ids(api_alone, SubmitRequest)) - before, 30, "the submission")

    (request_id,) = asyncio.run(scenario())
    _wait_aborted(api_alone, request_id)


def test_metrics_have_the_pagedserve_names(api_alone):
    text = httpx.get(api_alone.base_url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"pagedserve:{name}" in text, name
