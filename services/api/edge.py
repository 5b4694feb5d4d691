"""What every route shares at the HTTP edge: app state, bounded bodies, the one validation
step, errors, auth, and the one disconnect path."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import HTTPConnection

from pagedserve.services.api.admission import RequestLimits
from pagedserve.services.api.inputs import ModelInfo, prepare
from pagedserve.services.api.loop import ApiLoop, RedisUnavailable
from pagedserve.services.api.metrics import ApiMetrics
from pagedserve.services.api.prompt_batch import PromptBatch, prompt_copies, split_prompts
from pagedserve.services.api.protocol import ApiError, CompletionRequest, parse_body
from pagedserve.services.api.request import ApiRequest

CLIENT_GONE = "client disconnected"

log = logging.getLogger("pagedserve.api")


@dataclass
class ApiState:
    loop: ApiLoop
    tokenizer: object
    info: ModelInfo
    metrics: ApiMetrics
    max_body_bytes: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    api_key: str | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    async def accept(self, raw: bytes | str, conn: HTTPConnection, cls=None, listen: bool = True,
                     many: bool = False) -> ApiRequest | PromptBatch:
        """Every submitting route's edge: parse and validate once (protocol, inputs.prepare), then
        admit and submit. ApiError means nothing was submitted. `conn` gives the tenant when the
        body names no user; listen False: nobody streams it from here (REST); many: a list of
        prompts is a PromptBatch (/v1/completions)."""
        body = parse_body(raw, cls)
        tenant = tenant_of(conn.headers)
        parts = split_prompts(body) if many and isinstance(body, CompletionRequest) and (
            isinstance(body.prompt, list) or body.n > 1) else None
        if parts is None:
            request = await asyncio.to_thread(prepare, body, self.tokenizer, self.info, self.limits, tenant)
        else:
            request = PromptBatch(await asyncio.to_thread(
                lambda: [prepare(part, self.tokenizer, self.info, self.limits, tenant) for part in parts]),
                prompt_copies(body))
        if cls is None and request.prompt is not None:  # REST and the WebSocket report no prompt logprobs
            field = "echo" if request.prompt.echo else "prompt_logprobs"
            raise ApiError(400, f"{field} is served on /v1/completions and /v1/chat/completions only", param=field,
                           code="unsupported")
        await self.start(request, listen)
        return request

    def open(self, request: ApiRequest, listen: bool = True) -> ApiRequest:
        """Its sequences, ended through this api's loop; listen False: nobody streams it from here."""
        return request.open(self.loop.api_id, self.tokenizer, self.metrics, self.loop.end, listen)

    async def start(self, request: ApiRequest | PromptBatch, listen: bool = True) -> None:
        """Admit, record and submit it once; ApiError (429, 503): nothing was submitted (a batch's
        prompts submitted already are aborted)."""
        if not isinstance(request, PromptBatch):
            return await self._start(request, listen)
        for p, one in enumerate(request.requests):
            try:
                await self._start(one, listen)
            except ApiError:
                for started in request.requests[:p + 1]:
                    started.close(f"prompt {p} of its batch was refused")
                raise

    async def _start(self, request: ApiRequest, listen: bool) -> None:
        self.open(request, listen)
        self.loop.admission.check(request.tenant)
        try:
            await self.loop.submit(request)
        except RedisUnavailable as e:
            raise ApiError(503, f"the server cannot take requests right now: {e}", code="unavailable",
                           type="service_unavailable") from None
        log.info("request %s submitted: %d prompt tokens, max_tokens %d, n %d", request.request_id,
                 len(request.prompt_token_ids), request.sampling.max_tokens, len(request.gens))


def tenant_of(headers) -> str | None:
    """The tenant of a request's API key: a digest, never the key itself (it ends up in logs)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:12]


def state_of(request) -> ApiState:
    return request.app.state.api


def error_response(error: ApiError, metrics: ApiMetrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.rejected.labels(status=str(error.status)).inc()
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) one over `limit` bytes without reading it all, and (415)
    one that is not JSON."""
    check_content_type(request.headers)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes is over the limit of {limit} bytes",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def check_content_type(headers) -> None:
    """415 unless the body is JSON (a body with no content-type header is taken as JSON)."""
    value = headers.get("content-type")
    if value is None:
        return
    media = value.split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"the body must be JSON (content-type: application/json), got {media!r}",
                       code="unsupported_media_type", param="content-type")


async def while_connected(receive, request: ApiRequest | None, work: Coroutine, ended: str) -> None:
    """The api's one disconnect path: `work` runs beside a listener on `receive`. A disconnect
    aborts `request` (why: CLIENT_GONE) and cancels work; a WebSocket {"type": "abort"} aborts it
    and work goes on (it sends the finals). However it ends, every sequence still open is
    aborted with `ended`. request None (an attached follower): a disconnect only stops work."""
    listener = asyncio.create_task(_listen(receive, request))
    worker = asyncio.create_task(work)
    try:
        await asyncio.wait((listener, worker), return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        worker.cancel()
        if request is not None:
            request.close(ended)
        await asyncio.gather(listener, worker, return_exceptions=True)
    if not worker.cancelled():
        worker.result()  # its error, if it failed


async def _listen(receive, request: ApiRequest | None) -> None:
    while True:
        try:
            message = await receive()
        except (RuntimeError, OSError):  # the socket was closed by our side already
            return
        kind = message["type"]
        if kind in ("http.disconnect", "websocket.disconnect"):
            if request is not None:
                request.close(CLIENT_GONE)
            return
        if kind == "websocket.receive" and request is not None and _wants_abort(message.get("text")):
            request.close("aborted by the client")


def _wants_abort(text: str | None) -> bool:
    try:
        return json.loads(text or "{}").get("type") == "abort"
    except (ValueError, AttributeError):
        return False


async def refuse(error: ApiError, scope, receive, send) -> None:
    """Answer an ASGI connection with an error before any route (a WebSocket: accept, error, close)."""
    if scope["type"] == "http":
        return await error_response(error)(scope, receive, send)
    message = await receive()
    if message["type"] != "websocket.connect":
        return None
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps({"type": "error", "status": error.status,
                                                              "message": error.message, "code": error.code})})
    await send({"type": "websocket.close", "code": 1008 if error.status < 500 else 1013,
                "reason": f"{error.code}: {error.message}".encode()[:123].decode(errors="ignore")})


class AuthMiddleware:
    """Pure ASGI: every /v1 and /admin route needs `Authorization: Bearer <key>`, else a 401."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or not self.api_key or self._allowed(scope):
            return await self.app(scope, receive, send)
        error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key", type="authentication_error")
        return await refuse(error, scope, receive, send)

    def _allowed(self, scope) -> bool:
        path = scope.get("path", "")
        if not (path.startswith("/v1") or path.startswith("/admin")):
            return True
        headers = dict(scope.get("headers") or [])
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
