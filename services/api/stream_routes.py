"""REST submission (/v1/requests) and WebSocket streaming (/v1/stream, .../stream).

Server messages: "delta" (index, text, token_ids), one "final" per choice, or "error" then close.
A chat with tools streams as the OpenAI routes do (tool_calls.ToolView): a call's text is held back,
and the final carries its `tool_calls` with finish_reason "tool_calls".
Closing a /v1/stream socket aborts the request; leaving an attached stream does not (DELETE does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from pagedserve.services.api.edge import CLIENT_GONE, read_body, state_of, while_connected
from pagedserve.services.api.generation import Output
from pagedserve.services.api.protocol import ApiError
from pagedserve.services.api.request import ApiRequest
from pagedserve.services.api.tool_calls import ToolView

log = logging.getLogger("pagedserve.api")
router = APIRouter()
FIRST_MESSAGE_TIMEOUT_S = 60.0  # a WebSocket that never sends its request is closed with a 408


def _not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request {request_id!r} on this server", code="request_not_found")


def delta_message(request: ApiRequest, index: int, out: Output, text: str) -> dict:
    msg = {"type": "delta", "request_id": request.request_id, "seq": out.seq, "index": index, "text": text,
           "token_ids": out.token_ids}
    if request.sampling.logprobs is not None:
        msg["logprobs"] = [{"token_id": s.token_id, "logprob": s.logprob, "top_logprobs": s.top_logprobs}
                           for s in out.logprobs]
    return msg


def final_message(request: ApiRequest, index: int, out: Output | None = None, finish_reason: str | None = None,
                  calls: list[dict] | None = None) -> dict:
    gen = request.gens[index]
    msg = {"type": "final", "request_id": request.request_id, "seq": out.seq if out else request.seq, "index": index,
           "finish_reason": finish_reason or gen.finish_reason, "usage": gen.usage()}
    return msg | ({"tool_calls": calls} if calls else {}) | ({"error": out.error} if out is not None and out.error
                                                              else {})


def stream_messages(request: ApiRequest, index: int, out: Output, view: ToolView | None = None) -> list[dict]:
    text, calls, finish = (out.text, [], out.finish_reason) if view is None else \
        view.step(request.gens[index].text, out.finish_reason)
    msgs = [delta_message(request, index, out, text)] if text or out.token_ids else []
    return msgs + ([final_message(request, index, out, finish, calls)] if finish is not None else [])


DELETE_WAIT_S = 5.0  # how long DELETE waits for the abort to reach the record


def record_message(request_id: str, seq: int, event: dict) -> list[dict]:
    """The stream messages of one record event (records.py)."""
    msgs = []
    if event.get("text") or event.get("token_ids"):
        msg = {"type": "delta", "request_id": request_id, "seq": seq, "index": event["index"], "text": event["text"],
               "token_ids": event["token_ids"]}
        if "logprobs" in event:
            msg["logprobs"] = event["logprobs"]
        msgs.append(msg)
    if event.get("finish_reason") is not None:
        msgs.append({"type": "final", "request_id": request_id, "seq": seq, "index": event["index"],
                     "finish_reason": event["finish_reason"], "usage": event.get("usage")}
                    | {key: event[key] for key in ("tool_calls", "error") if event.get(key)})
    return msgs


def _cursor(value: str | None) -> int:
    if value is None or value == "":
        return 0
    if not value.isdigit():
        raise ApiError(400, f"invalid cursor {value!r}: the seq of the last event received (an integer >= 0)",
                       code="invalid_cursor", param="cursor")
    return int(value)


@router.post("/v1/requests", status_code=202)
async def submit(request: Request) -> JSONResponse:
    state = state_of(request)
    api_request = await state.accept(await read_body(request, state.max_body_bytes), request, listen=False)
    return JSONResponse({"request_id": api_request.request_id}, status_code=202)


@router.get("/v1/requests/{request_id}")
async def get_request(request_id: str, request: Request) -> dict:
    snapshot = await state_of(request).loop.records.snapshot(request_id)
    if snapshot is None:
        raise _not_found(request_id)
    return snapshot


@router.delete("/v1/requests/{request_id}")
async def delete_request(request_id: str, request: Request) -> dict:
    loop = state_of(request).loop
    if not await loop.cancel(request_id, "deleted by the client"):
        raise _not_found(request_id)
    deadline = time.monotonic() + DELETE_WAIT_S
    while True:  # the abort goes through the scheduler unless this api ended it itself
        snapshot = await loop.records.snapshot(request_id)
        if snapshot is None or snapshot["status"] not in ("queued", "running") or time.monotonic() > deadline:
            return snapshot or {"request_id": request_id, "status": "aborted"}
        await asyncio.sleep(0.05)


@router.get("/v1/requests/{request_id}/stream")
async def follow_sse(request_id: str, request: Request) -> StreamingResponse:
    """SSE of a record; each event's `id` is its seq, so `Last-Event-ID` resumes without gaps."""
    cursor = _cursor(request.query_params.get("cursor") or request.headers.get("last-event-id"))
    records = state_of(request).loop.records
    if await records.load(request_id) is None:
        raise _not_found(request_id)

    async def sse():
        async for seq, event in records.follow(request_id, cursor):
            msgs = record_message(request_id, seq, event)
            for i, msg in enumerate(msgs):  # id on the last message only: a cut-off client resumes before it
                event_id = f"id: {seq}\n" if i == len(msgs) - 1 else ""
                yield f"{event_id}data: {json.dumps(msg, ensure_ascii=False)}\n\n".encode()

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.websocket("/v1/requests/{request_id}/stream")
async def follow_ws(websocket: WebSocket, request_id: str) -> None:
    """The record's events as stream messages; ?cursor=<seq> resumes after that event."""
    await websocket.accept()
    try:
        cursor = _cursor(websocket.query_params.get("cursor"))
    except ApiError as e:
        return await _send_error(websocket, e)
    events = state_of(websocket).loop.records.follow(request_id, cursor)

    async def forward() -> None:
        try:
            async for seq, event in events:
                for msg in record_message(request_id, seq, event):
                    await websocket.send_json(msg)
            await websocket.close()
        except KeyError:
            await _send_error(websocket, _not_found(request_id))
        except (WebSocketDisconnect, RuntimeError, OSError):  # a send after the client left
            pass

    try:  # leaving an attached stream aborts nothing (request None)
        await while_connected(websocket.receive, None, forward(), CLIENT_GONE)
    finally:
        await events.aclose()


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
        request = await state.accept(raw, websocket)
    except ApiError as e:
        state.metrics.rejected.labels(status=str(e.status)).inc()
        return await _send_error(websocket, e)
    await while_connected(websocket.receive, request, _send_outputs(websocket, request), CLIENT_GONE)


async def _send_outputs(websocket: WebSocket, request: ApiRequest) -> None:
    finals_sent: set[int] = set()
    views = [ToolView(request.tool_use) if request.tool_use else None for _ in request.gens]
    try:
        async for index, out in request.outputs():
            for msg in stream_messages(request, index, out, views[index]):
                await websocket.send_json(msg)
            if out.finish_reason is not None:
                finals_sent.add(index)
        if request.why != CLIENT_GONE:
            for index in range(len(request.gens)):
                if index not in finals_sent:  # aborted here (the client asked), not by a delta
                    await websocket.send_json(final_message(request, index))
            await websocket.close()
    except (WebSocketDisconnect, RuntimeError, OSError):  # a send after the client left
        pass


async def _send_error(websocket: WebSocket, error: ApiError) -> None:
    """The error as a JSON message, then a close whose reason says it too (at most 123 bytes)."""
    if websocket.application_state == WebSocketState.CONNECTED:
        await websocket.send_json({"type": "error", "status": error.status, "message": error.message,
                                   "code": error.code, "param": error.param})
        reason = f"{error.code}: {error.message}".encode()[:123].decode(errors="ignore")
        await websocket.close(code=1008 if error.status < 500 else 1011, reason=reason)
