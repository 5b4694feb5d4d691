"""Two api processes serve one port (--reuse-port, each its own --api-id), the back-end
played by the in-process Responder: requests spread over both, and every record is
answered by whichever replica a client reaches."""

from __future__ import annotations

import uuid

import httpx

from pagedserve.shared.streams import Keys
from tests.api.conftest import ApiProcess, free_port
from tests.api.inprocess import Responder, expected_text
from tests.services.conftest import delete_prefix, wait_for


def test_two_replicas_share_a_port(tmp_path):
    prefix, port = f"test-rep-{uuid.uuid4().hex[:8]}", free_port()
    apis = [ApiProcess(tmp_path, prefix, port=port, args=["--reuse-port", "--api-id", f"rep{i}"]) for i in range(2)]
    try:
        with Responder(Keys(prefix)) as responder:
            for api in apis:
                api.wait_healthy()
            base = apis[0].base_url
            # each replica's readiness gate has seen the back-end (a fresh connection each time)
            wait_for(lambda: all(httpx.get(base + "/ready").status_code == 200 for _ in range(8)), 30, "ready")
            ids = []
            for _ in range(24):  # a new connection each: the kernel spreads them over the replicas
                with httpx.Client(base_url=base, timeout=30) as c:
                    ids.append(c.post("/v1/requests", json={"prompt": "Hello", "max_tokens": 6}).json()["request_id"])

            def all_finished():
                with httpx.Client(base_url=base, timeout=30) as c:
                    bodies = [c.get(f"/v1/requests/{i}").json() for i in ids]
                return bodies if all(b["status"] == "finished" for b in bodies) else None

            bodies = wait_for(all_finished, 60, "every record to finish")
            assert [b["text"] for b in bodies] == [expected_text(6)] * 24
            by_api = [s.api_id for s in responder.submits]
            assert len(by_api) == 24 and set(by_api) == {"rep0", "rep1"}, by_api
    finally:
        for api in apis:
            api.close()
        delete_prefix(prefix)
