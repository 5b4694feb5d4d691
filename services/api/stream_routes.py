"""REST submission (/v1/requests) and WebSocket streaming (/v1/stream, .../stream).

Stream protocol (WebSocket, and SSE for the attach route): the client sends one JSON
object (a completions or chat body); the server sends {"type": "delta", "text",
"token_ids"} messages, then {"type": "final", "finish_reason", "usage"} and closes; or
{"type": "error", "status": 4xx, "message"} and closes. A client that closes the socket
aborts its request; one that sends {"type": "abort"} too. Attaching to a REST request
(`/v1/requests/{id}/stream`) replays what it has so far, then streams; leaving does not
abort it (DELETE does).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from services.api.edge import CLIENT_GONE, read_body, state_of
from services.api.generation import Generation, Output
from services.api.inputs import prepare
from services.api.protocol import ApiError, parse_body

log = logging.getLogger("pagedserve.api")
router = APIRouter()
FIRST_MESSAGE_TIMEOUT_S = 60.0  # a WebSocket that never sends its request is closed with a 408


def _not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request {request_id!r} on this server", code="request_not_found")


def delta_message(gen: Generation, out: Output) -> dict:
    msg = {"type": "delta", "request_id": gen.request_id, "text": out.text, "token_ids": out.token_ids}
    if gen.prepared.sampling.logprobs is not None:
        msg["logprobs"] = [{"token_id": s.token_id, "logprob": s.logprob, "top_logprobs": s.top_logprobs}
                           for s in out.logprobs]
    return msg


def final_message(gen: Generation) -> dict:
    return {"type": "final", "request_id": gen.request_id, "finish_reason": gen.finish_reason, "usage": gen.usage()}


def stream_messages(gen: Generation, out: Output) -> list[dict]:
    msgs = [delta_message(gen, out)] if out.text or out.token_ids else []
    return msgs + ([final_message(gen)] if out.finish_reason is not None else [])


# ---- REST ------------------------------------------------------------------------------

@router.post("/v1/requests", status_code=202)
async def submit(request: Request) -> JSONResponse:
    state = state_of(request)
    body = parse_body(await read_body(request, state.max_body_bytes))
    prepared = await asyncio.to_thread(prepare, body, state.tokenizer, state.info)
    gen = state.generation(prepared, request)
    await gen.start()
    state.rest.add(gen)
    return JSONResponse({"request_id": gen.request_id}, status_code=202)


@router.get("/v1/requests/{request_id}")
async def get_request(request_id: str, request: Request) -> dict:
    record = state_of(request).rest.get(request_id)
    if record is None:
        raise _not_found(request_id)
    return record.snapshot()


@router.delete("/v1/requests/{request_id}")
async def delete_request(request_id: str, request: Request) -> dict:
    record = state_of(request).rest.get(request_id)
    if record is None:
        raise _not_found(request_id)
    record.gen.abort("deleted by the client")
    return record.snapshot()


@router.get("/v1/requests/{request_id}/stream")
async def follow_sse(request_id: str, request: Request) -> StreamingResponse:
    record = state_of(request).rest.get(request_id)
    if record is None:
        raise _not_found(request_id)

    async def events():
        async for out in record.follow():
            for msg in stream_messages(record.gen, out):
                yield f"data: {json.dumps(msg, ensure_ascii=False)}\n\n".encode()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- WebSocket -------------------------------------------------------------------------

@router.websocket("/v1/requests/{request_id}/stream")
async def follow_ws(websocket: WebSocket, request_id: str) -> None:
    await websocket.accept()
    record = state_of(websocket).rest.get(request_id)
    if record is None:
        return await _send_error(websocket, _not_found(request_id))
    watcher = asyncio.create_task(_watch_close(websocket, None))
    try:
        async for out in record.follow():
            if watcher.done():
                return
            for msg in stream_messages(record.gen, out):
                await websocket.send_json(msg)
        await websocket.close()
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        watcher.cancel()


@router.websocket("/v1/stream")
async def stream(websocket: WebSocket) -> None:
    await websocket.accept()
    state = state_of(websocket)
    try:
        try:
            message = await asyncio.wait_for(websocket.receive(), FIRST_MESSAGE_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(408, f"no request received within {FIRST_MESSAGE_TIMEOUT_S:.0f}s", code="timeout") from None
        if message["type"] == "websocket.disconnect":
            return
        raw = message.get("text") if message.get("text") is not None else message.get("bytes") or b""
        if len(raw) > state.max_body_bytes:
            raise ApiError(413, f"request message is over the limit of {state.max_body_bytes} bytes",
                           code="body_too_large")
        prepared = await asyncio.to_thread(prepare, parse_body(raw), state.tokenizer, state.info)
        gen = state.generation(prepared, websocket)
        await gen.start()
    except ApiError as e:
        state.metrics.rejected.labels(status=str(e.status)).inc()
        return await _send_error(websocket, e)
    watcher = asyncio.create_task(_watch_close(websocket, gen))
    final_sent = False
    try:
        while (out := await gen.next()) is not None:
            for msg in stream_messages(gen, out):
                await websocket.send_json(msg)
            final_sent = out.finish_reason is not None
        if gen.why != CLIENT_GONE:
            if not final_sent:  # aborted here (the client asked), not by a delta
                await websocket.send_json(final_message(gen))
            await websocket.close()
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        watcher.cancel()
        gen.close(CLIENT_GONE)


async def _watch_close(websocket: WebSocket, gen: Generation | None) -> None:
    """Until the client closes (or sends {"type": "abort"}): then abort `gen`, if any."""
    while True:
        try:
            message = await websocket.receive()
        except (WebSocketDisconnect, RuntimeError):  # closed by our side already
            return
        if message["type"] == "websocket.disconnect":
            if gen is not None:
                gen.abort(CLIENT_GONE)
            return
        try:
            wants_abort = json.loads(message.get("text") or "{}").get("type") == "abort"
        except (ValueError, AttributeError):
            wants_abort = False
        if wants_abort and gen is not None:
            gen.abort("aborted by the client")


async def _send_error(websocket: WebSocket, error: ApiError) -> None:
    if websocket.application_state == WebSocketState.CONNECTED:
        await websocket.send_json({"type": "error", "status": error.status, "message": error.message,
                                   "code": error.code})
        await websocket.close(code=1008 if error.status < 500 else 1011)
