"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (whole or SSE), /v1/models.

Every rejection (4xx/503) happens before a response starts, never after a 200 opened a stream.
"""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.services.api import openai_format as fmt
from pagedserve.services.api.choices import Choices
from pagedserve.services.api.edge import CLIENT_GONE, close_on_disconnect, read_body, state_of
from pagedserve.services.api.inputs import MAX_N, prepare
from pagedserve.services.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body

log = logging.getLogger("pagedserve.api")
router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = state_of(request)
    card = {"id": state.info.served_name, "object": "model", "created": state.started, "owned_by": "pagedserve",
            "root": state.info.served_name, "parent": None, "max_model_len": state.info.max_model_len}
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatCompletionRequest)


async def _serve(request: Request, cls) -> Response:
    state = state_of(request)
    body = parse_body(await read_body(request, state.max_body_bytes), cls)
    prepared = await asyncio.to_thread(prepare, body, state.tokenizer, state.info, MAX_N)
    choices = Choices(state, prepared, request)
    await choices.start()
    if prepared.stream:
        return GenerationStream(choices, _sse_events(choices))
    watcher = asyncio.create_task(close_on_disconnect(request.receive, choices))
    try:
        async for _ in choices.outputs():
            pass
    finally:
        watcher.cancel()
        choices.close("request handler ended early")
    if choices.why == CLIENT_GONE:
        log.info("request %s: client hung up, aborted", choices.request_id)
        return Response(status_code=499)
    body = fmt.chat_response(choices) if prepared.kind == "chat" else fmt.completion_response(choices)
    return JSONResponse(body)


async def _sse_events(choices: Choices):
    chat = choices.prepared.kind == "chat"
    logprobs = choices.prepared.sampling.logprobs is not None
    if chat:
        for index in range(len(choices.gens)):
            yield fmt.sse(fmt.chat_role_chunk(choices, index))
    text_offsets = [0] * len(choices.gens)
    templates = [fmt.ChunkTemplate(choices, i) for i in range(len(choices.gens))] \
        if fmt.ChunkTemplate.applies(choices) else None
    async for index, out in choices.outputs():  # GenerationStream watches the client
        if not out.text and out.finish_reason is None and not (logprobs and out.token_ids):
            continue  # nothing a client can use yet (e.g. half a character)
        if templates is not None and out.finish_reason is None:
            yield templates[index].sse(out.text)
        else:
            yield fmt.sse(fmt.chat_chunk(choices, index, out) if chat
                          else fmt.completion_chunk(choices, index, out, text_offsets[index]))
        text_offsets[index] += len(out.text)
    if choices.why == CLIENT_GONE:
        return
    if choices.prepared.include_usage:
        yield fmt.sse(fmt.usage_chunk(choices))
    yield fmt.sse("[DONE]")


class GenerationStream(StreamingResponse):
    """An SSE response that aborts its generations however the stream ends."""

    def __init__(self, choices: Choices, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        # listen for disconnect ourselves: Starlette skips it from ASGI spec 2.4 on
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await close_on_disconnect(receive, self.choices)
                group.cancel_scope.cancel()
        finally:
            self.choices.close("stream ended early")
