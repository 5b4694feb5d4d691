"""Until the stack is ready (Redis up, scheduler, kvstore and a worker heartbeating), routes that
need the model answer 503 "not_ready" with Retry-After rather than queue work nobody will run.
"""

from __future__ import annotations

import asyncio
import time

from pagedserve.services.api.edge import refuse
from pagedserve.services.api.protocol import ApiError

CHECK_INTERVAL_S = 1.0
RETRY_AFTER_S = 5
# (method, path) that submit work: HTTP POSTs and the streaming WebSocket
GATED = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
         ("POST", "/v1/requests"),
         ("WS", "/v1/stream")}


class Readiness:
    """What the back-end still lacks, cached for CHECK_INTERVAL_S; GET /ready refreshes it."""

    def __init__(self, loop) -> None:
        self.loop = loop
        self._missing: list[str] = ["redis"]
        self._checked_at = float("-inf")
        self._check: asyncio.Task | None = None  # the one check under way: a burst of requests shares it

    async def missing(self, fresh: bool = False) -> list[str]:
        if fresh or time.monotonic() - self._checked_at >= CHECK_INTERVAL_S:
            if self._check is None:
                self._check = asyncio.create_task(self._refresh())
            await asyncio.shield(self._check)  # a caller cancelled leaves it to the others
        return self._missing

    async def _refresh(self) -> None:
        try:
            self._missing = await self.loop.missing_services()
            self._checked_at = time.monotonic()
        finally:
            self._check = None


class ReadyGate:
    """Pure ASGI middleware in front of the routes in GATED."""

    def __init__(self, app, readiness: Readiness) -> None:
        self.app, self.readiness = app, readiness

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        method = "WS" if scope["type"] == "websocket" else scope.get("method", "")
        if (method, scope.get("path", "")) not in GATED or not (missing := await self.readiness.missing()):
            return await self.app(scope, receive, send)
        error = ApiError(503, f"the server is not ready yet (waiting for: {', '.join(missing)}); "
                         f"retry later or wait for GET /ready", code="not_ready", type="service_unavailable",
                         headers={"Retry-After": str(RETRY_AFTER_S)})
        return await refuse(error, scope, receive, send)
