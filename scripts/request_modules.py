"""The pagedserve modules whose code runs in the api process for one POST /v1/completions, from
the route to the scheduler's stream and back (non-streaming, then streaming): the real app in
this process on the real Redis, the scheduler played by tests/api/inprocess.Responder.

    PYTHONPATH=. python3 scripts/request_modules.py      # needs Redis at REDIS_URL or 127.0.0.1:6379
"""

from __future__ import annotations

import sys
import threading
import uuid

from pagedserve.shared.streams import Keys
from tests.api.inprocess import Responder, api_client
from tests.services.conftest import delete_prefix

BODY = {"model": "smollm2", "prompt": "hi", "max_tokens": 4}


def main() -> None:
    seen: set[str] = set()
    tracing = threading.Event()

    def on_call(frame, event, _arg):
        if tracing.is_set() and event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("pagedserve."):
                seen.add(name)

    prefix = f"request-modules-{uuid.uuid4().hex[:8]}"
    with Responder(Keys(prefix)):
        threading.setprofile(on_call)  # the app's event loop runs in a thread the client starts
        with api_client(prefix) as client:
            for stream in (False, True):
                client.post("/v1/completions", json=BODY)  # warm: imports, caches
                seen.clear()
                tracing.set()
                sys.setprofile(on_call)
                response = client.post("/v1/completions", json={**BODY, "stream": stream})
                sys.setprofile(None)
                tracing.clear()
                assert response.status_code == 200, response.text
                print(f"stream={stream}: {len(seen)} modules: {' '.join(sorted(m[11:] for m in seen))}")
        threading.setprofile(None)
    delete_prefix(prefix)


if __name__ == "__main__":
    main()
