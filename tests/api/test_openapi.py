"""/openapi.json describes every route's body and responses; /docs serves; no body a
client can send to a described route makes the server answer 5xx (a small fuzz of the
schema's operations, in-process)."""

from __future__ import annotations

import uuid

import pytest

from pagedserve.shared.streams import Keys
from tests.api.inprocess import Responder, api_client
from tests.services.conftest import delete_prefix

BODIES = [{}, [], {"prompt": 1}, {"prompt": "hi", "max_tokens": -1}, {"messages": "x"}, {"name": 3},
          {"prompt": "x" * 5000, "max_tokens": 1}, {"prompt": [[1, 2], [3]]}, {"prompt": "hi", "n": 99},
          {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2}]


@pytest.fixture(scope="module")
def client():
    prefix = f"test-oa-{uuid.uuid4().hex[:8]}"
    with Responder(Keys(prefix)), api_client(prefix, api_key="k") as c:
        yield c
    delete_prefix(prefix)


def test_schema_describes_bodies_and_responses(client):
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/requests", "/admin/policy"):
        assert "requestBody" in paths[path]["post"], path
    assert {"prompt", "max_tokens", "stream"} <= set(schema["components"]["schemas"]["CompletionRequest"]["properties"])
    record = paths["/v1/requests/{request_id}"]["get"]["responses"]
    assert record["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/RequestRecord")
    assert record["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    for methods in paths.values():
        for operation in methods.values():
            assert operation["responses"] and "422" not in operation["responses"]
    assert client.get("/docs").status_code == 200


def test_no_body_gets_a_server_error(client):
    schema = client.get("/openapi.json").json()
    statuses = []
    for path, methods in schema["paths"].items():
        concrete = path.replace("{request_id}", "cmpl-" + uuid.uuid4().hex)
        for method in methods:
            if concrete.endswith("/stream") or concrete == "/admin/prefix-cache/reset":
                continue  # a stream waits for its request; a reset waits for a kvstore
            for body in BODIES if method == "post" else [None]:
                r = client.request(method.upper(), concrete, json=body)
                statuses.append((method, path, r.status_code))
    assert [s for s in statuses if s[2] >= 500 and s[1] not in ("/admin/policy",)] == []
    assert {s[2] for s in statuses} >= {200, 202, 400, 404}
