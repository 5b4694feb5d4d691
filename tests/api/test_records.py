"""Request records in Redis, in-process (tests/api/inprocess.py): any replica answers GET,
DELETE and streams a request; a stream resumes from a cursor without gaps or duplicates;
an api restarted under its id finishes the records it had; nothing waits before ready."""

from __future__ import annotations

import json
import socket
import uuid

import pytest

from pagedserve.shared.streams import Keys
from tests.api.inprocess import Responder, api_client, expected_text, wait_status
from tests.services.conftest import delete_prefix, wait_for


@pytest.fixture
def prefix():
    value = f"test-rec-{uuid.uuid4().hex[:10]}"
    yield value
    delete_prefix(value)


def sse_events(text: str) -> list[tuple[int, dict]]:
    """(id, data) of each SSE event of a response body."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((int(fields.get("id", 0)) or None, json.loads(fields["data"])))
    return out


def test_rest_record_is_answered_by_any_replica(prefix):
    with Responder(Keys(prefix)) as responder, api_client(prefix) as a, api_client(prefix) as b:
        request_id = a.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 12}).json()["request_id"]
        body = wait_status(b, request_id, "finished")
        assert body["text"] == expected_text(12)
        assert len(body["token_ids"]) == 12 and body["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 12
        assert a.get(f"/v1/requests/{request_id}").json() == body
        assert len(responder.submits) == 1
        assert b.get("/v1/requests/cmpl-nosuch").status_code == 404


def test_delete_from_another_replica_aborts(prefix):
    with Responder(Keys(prefix)) as responder, api_client(prefix) as a, api_client(prefix) as b:
        with responder.paused():
            request_id = a.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 12}).json()["request_id"]
            wait_for(lambda: responder.running, 10, "the submission")
            assert b.get(f"/v1/requests/{request_id}").json()["status"] == "queued"
            body = b.delete(f"/v1/requests/{request_id}").json()
        assert body["status"] == "aborted" and body["finish_reason"] == "abort"
        assert responder.aborts == [request_id]


def test_sse_resumes_from_last_event_id_on_another_replica(prefix):
    with Responder(Keys(prefix), per_step=1) as _r, api_client(prefix) as a, api_client(prefix) as b:
        request_id = a.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 16}).json()["request_id"]
        wait_status(a, request_id, "finished")
        whole = sse_events(a.get(f"/v1/requests/{request_id}/stream").text)
        seqs = [seq for seq, _ in whole if seq is not None]
        assert seqs == list(range(1, 17))  # 16 one-token events, the last with the final
        assert [m["type"] for seq, m in whole if seq is None] == ["delta"]  # before that final
        cut = seqs[6]
        rest = sse_events(b.get(f"/v1/requests/{request_id}/stream", headers={"Last-Event-ID": str(cut)}).text)
        head = whole[:7]
        text = "".join(e.get("text", "") for _, e in head + rest if e["type"] == "delta")
        ids = [t for _, e in head + rest if e["type"] == "delta" for t in e["token_ids"]]
        assert text == expected_text(16) and len(ids) == 16
        assert [e["finish_reason"] for _, e in rest if e["type"] == "final"] == ["length"]
        assert b.get(f"/v1/requests/{request_id}/stream?cursor=x").status_code == 400


def test_websocket_follow_resumes_from_cursor(prefix):
    with Responder(Keys(prefix), per_step=1) as _r, api_client(prefix) as a:
        with a.websocket_connect("/v1/stream") as ws:
            ws.send_text(json.dumps({"prompt": "Hello", "max_tokens": 10}))
            first = ws.receive_json()
            request_id, seq = first["request_id"], first["seq"]
        # the socket closed: that aborts a /v1/stream request, so follow a REST one instead
        request_id = a.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 10}).json()["request_id"]
        wait_status(a, request_id, "finished")
        with a.websocket_connect(f"/v1/requests/{request_id}/stream?cursor=3") as ws:
            msgs = []
            while not msgs or msgs[-1]["type"] != "final":
                msgs.append(ws.receive_json())
        assert seq == 1
        assert [m["seq"] for m in msgs if m["type"] == "delta"] == list(range(4, 11))
        assert "".join(m["text"] for m in msgs if m["type"] == "delta") == expected_text(10)[len(expected_text(3)):]


def test_openai_routes_stream_from_the_loop(prefix):
    with Responder(Keys(prefix)) as _r, api_client(prefix) as a:
        whole = a.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 9}).json()
        assert whole["choices"][0]["text"] == expected_text(9)
        streamed = a.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 9, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(9)
        assert a.get(f"/v1/requests/{whole['id']}").json()["text"] == expected_text(9)


def test_restarted_api_finishes_its_records(prefix):
    api_id = f"api-{uuid.uuid4().hex[:6]}"
    with Responder(Keys(prefix), per_step=1) as responder:
        with api_client(prefix, api_id) as a:
            with responder.paused():
                ids = [a.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 20, "n": n,
                                                    "temperature": 0.5}).json()["request_id"] for n in (1, 1, 2)]
                wait_for(lambda: len(responder.running) == 4, 10, "the submissions")
        # the api is gone; the back-end goes on writing to its deltas stream
        wait_for(lambda: not responder.running, 10, "the responder to finish")
        with api_client(prefix, api_id) as again, api_client(prefix) as other:
            for request_id in ids:
                body = wait_status(other, request_id, "finished")
                assert [(c["text"], len(c["token_ids"])) for c in body["choices"]] == \
                    [(expected_text(20), 20)] * len(body["choices"])
            assert len(body["choices"]) == 2
            assert again.get(f"/v1/requests/{ids[0]}").json()["status"] == "finished"


def test_not_ready_answers_503_with_retry_after(prefix):
    with Responder(Keys(prefix), ready=False) as responder, api_client(prefix, wait_ready=False, api_key="k") as a:
        r = a.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["code"] == "not_ready"
        assert a.post("/v1/requests", json={"prompt": "Hello"}).status_code == 503
        with a.websocket_connect("/v1/stream") as ws:
            msg = ws.receive_json()
        assert msg["status"] == 503 and msg["code"] == "not_ready"
        assert a.get("/v1/models").status_code == 200
        assert responder.submits == []


def test_size_errors_name_the_parameter_and_websocket_errors_say_why(prefix):
    with Responder(Keys(prefix)) as responder, api_client(prefix) as a:
        huge = "word " * 400_000  # 2 MB: under the body limit, far over the context
        error = a.post("/v1/completions", json={"prompt": huge, "max_tokens": 4}).json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        error = a.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]}).json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        error = a.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}).json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        with a.websocket_connect("/v1/stream") as ws:
            ws.send_text(json.dumps({"prompt": "hi", "max_tokens": "5"}))
            msg = ws.receive_json()
            close = ws.receive()
        assert msg["type"] == "error" and msg["status"] == 400 and msg["param"] == "max_tokens"
        assert close["type"] == "websocket.close" and close["code"] == 1008
        assert close["reason"].startswith("invalid_type: invalid value for 'max_tokens'")
        assert responder.submits == []


def test_redis_down_is_a_503_never_a_hang_or_a_500(prefix):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    with api_client(prefix, wait_ready=False, redis_url=dead) as a:
        for method, path in (("GET", "/v1/requests/cmpl-x"), ("DELETE", "/v1/requests/cmpl-x"),
                             ("GET", "/v1/requests/cmpl-x/stream"), ("POST", "/v1/completions")):
            r = a.request(method, path, json={"prompt": "hi"} if method == "POST" else None)
            assert r.status_code == 503, (method, path, r.text)
            assert r.json()["error"]["code"] in ("unavailable", "not_ready")
        assert a.get("/ready").json()["missing"] == ["redis"]


def test_n_choices_are_recorded_and_streamed_by_index(prefix):
    with Responder(Keys(prefix), per_step=1) as responder, api_client(prefix) as a, api_client(prefix) as b:
        request_id = a.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 5, "n": 3,
                                                  "temperature": 0.7}).json()["request_id"]
        body = wait_status(b, request_id, "finished")
        assert [c["text"] for c in body["choices"]] == [expected_text(5)] * 3
        assert body["usage"]["completion_tokens"] == 15 and "text" not in body
        events = sse_events(b.get(f"/v1/requests/{request_id}/stream").text)
        finals = [m for _, m in events if m["type"] == "final"]
        assert sorted(m["index"] for m in finals) == [0, 1, 2]
        for index in range(3):
            assert "".join(m["text"] for _, m in events if m["type"] == "delta" and m["index"] == index) == \
                expected_text(5)
        with a.websocket_connect("/v1/stream") as ws:
            ws.send_text(json.dumps({"prompt": "Hello", "max_tokens": 4, "n": 2, "temperature": 0.7}))
            msgs = []
            while sum(m["type"] == "final" for m in msgs) < 2:
                msgs.append(ws.receive_json())
        assert {m["index"] for m in msgs if m["type"] == "final"} == {0, 1}
        assert [s.sampling.n for s in responder.submits] == [3, 2]
