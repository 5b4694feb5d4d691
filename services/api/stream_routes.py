"""REST submission (/v1/requests) and WebSocket streaming (/v1/stream, .../stream).

Stream protocol (WebSocket, and SSE for the attach route): the client sends one JSON
object (a completions or chat body); the server sends {"type": "delta", "index", "text",
"token_ids"} messages, and for each choice (`n` of them, index 0..n-1) one {"type":
"final", "index", "finish_reason", "usage"} (usage: the prompt and that choice's tokens),
then closes after the last final; or {"type": "error", "status": 4xx, "message"} and
closes. A client that closes the socket aborts its request (every choice); one that sends
{"type": "abort"} too. Attaching to a REST request (`/v1/requests/{id}/stream`) replays
what it has so far, then streams; leaving does not abort it (DELETE does).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from services.api.choices import Choices
from services.api.edge import CLIENT_GONE, read_body, state_of
from services.api.generation import Output
from services.api.inputs import prepare
from services.api.protocol import ApiError, parse_body

log = logging.getLogger("pagedserve.api")
router = APIRouter()
FIRST_MESSAGE_TIMEOUT_S = 60.0  # a WebSocket that never sends its request is closed with a 408


def _not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request {request_id!r} on this server", code="request_not_found")


def delta_message(choices: Choices, index: int, out: Output) -> dict:
    msg = {"type": "delta", "request_id": choices.request_id, "index": index, "text": out.text,
           "token_ids": out.token_ids}
    if choices.prepared.sampling.logprobs is not None:
        msg["logprobs"] = [{"token_id": s.token_id, "logprob": s.logprob, "top_logprobs": s.top_logprobs}
                           for s in out.logprobs]
    return msg


def final_message(choices: Choices, index: int) -> dict:
    gen = choices.gens[index]
    return {"type": "final", "request_id": choices.request_id, "index": index, "finish_reason": gen.finish_reason,
            "usage": gen.usage()}


def stream_messages(choices: Choices, index: int, out: Output) -> list[dict]:
    msgs = [delta_message(choices, index, out)] if out.text or out.token_ids else []
    return msgs + ([final_message(choices, index)] if out.finish_reason is not None else [])


# ---- REST ------------------------------------------------------------------------------

@router.post("/v1/requests", status_code=202)
async def submit(request: Request) -> JSONResponse:
    state = state_of(request)
    body = parse_body(await read_body(request, state.max_body_bytes))
    prepared = await asyncio.to_thread(prepare, body, state.tokenizer, state.info)
    choices = Choices(state, prepared, request)
    await choices.start()
    state.rest.add(choices)
    return JSONResponse({"request_id": choices.request_id}, status_code=202)


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
    record.choices.close("deleted by the client")
    return record.snapshot()


@router.get("/v1/requests/{request_id}/stream")
async def follow_sse(request_id: str, request: Request) -> StreamingResponse:
    record = state_of(request).rest.get(request_id)
    if record is None:
        raise _not_found(request_id)

    async def events():
        async for index, out in record.follow():
            for msg in stream_messages(record.choices, index, out):
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
        async for index, out in record.follow():
            if watcher.done():
                return
            for msg in stream_messages(record.choices, index, out):
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
        choices = Choices(state, prepared, websocket)
        await choices.start()
    except ApiError as e:
        state.metrics.rejected.labels(status=str(e.status)).inc()
        return await _send_error(websocket, e)
    watcher = asyncio.create_task(_watch_close(websocket, choices))
    finals_sent: set[int] = set()
    try:
        async for index, out in choices.outputs(_watched_elsewhere):
            for msg in stream_messages(choices, index, out):
                await websocket.send_json(msg)
            if out.finish_reason is not None:
                finals_sent.add(index)
        if choices.why != CLIENT_GONE:
            for index in range(len(choices.gens)):
                if index not in finals_sent:  # aborted here (the client asked), not by a delta
                    await websocket.send_json(final_message(choices, index))
            await websocket.close()
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
    finally:
        watcher.cancel()
        choices.close(CLIENT_GONE)


async def _watched_elsewhere() -> bool:
    return False  # _watch_close aborts the choices the moment the socket closes


async def _watch_close(websocket: WebSocket, choices: Choices | None) -> None:
    """Until the client closes (or sends {"type": "abort"}): then abort every choice, if any."""
    while True:
        try:
            message = await websocket.receive()
        except (WebSocketDisconnect, RuntimeError):  # closed by our side already
            return
        if message["type"] == "websocket.disconnect":
            if choices is not None:
                choices.close(CLIENT_GONE)
            return
        try:
            wants_abort = json.loads(message.get("text") or "{}").get("type") == "abort"
        except (ValueError, AttributeError):
            wants_abort = False
        if wants_abort and choices is not None:
            choices.close("aborted by the client")


async def _send_error(websocket: WebSocket, error: ApiError) -> None:
    if websocket.application_state == WebSocketState.CONNECTED:
        await websocket.send_json({"type": "error", "status": error.status, "message": error.message,
                                   "code": error.code})
        await websocket.close(code=1008 if error.status < 500 else 1011)
