"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/responses (whole or SSE),
/v1/models[/{id}].

Every rejection (4xx/503) happens before a response starts, never after a 200 opened a stream.
"""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.services.api import openai_format as fmt
from pagedserve.services.api.edge import CLIENT_GONE, read_body, state_of, while_connected
from pagedserve.services.api.generation import Output
from pagedserve.services.api.openai_fields import check_fields, ignored_headers
from pagedserve.services.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_json_object
from pagedserve.services.api.request import ApiRequest
from pagedserve.services.api.responses_api import ResponseShape, chat_body
from pagedserve.services.api.tool_stream import tool_events

log = logging.getLogger("pagedserve.api")
router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    state = state_of(request)
    if not state.info.accepts(model_id):
        raise ApiError(404, f"the model '{model_id}' does not exist (this server serves '{state.info.served_name}')",
                       code="model_not_found", param="model")
    return _model_card(state)


def _model_card(state) -> dict:
    return {"id": state.info.served_name, "object": "model", "created": state.started, "owned_by": "pagedserve",
            "root": state.info.served_name, "parent": None, "max_model_len": state.info.max_model_len}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatCompletionRequest)


async def _serve(request: Request, cls) -> Response:
    state = state_of(request)
    raw = await read_body(request, state.max_body_bytes)
    ignored = check_fields(parse_json_object(raw), cls)
    api_request = await state.accept(raw, request, cls, many=cls is CompletionRequest)
    headers = ignored_headers(ignored, api_request.request_id)
    if api_request.stream:
        events = tool_events(api_request) if api_request.tool_use else _sse_events(api_request)
        return GenerationStream(api_request, events, headers)
    await while_connected(request.receive, api_request, _drain(api_request), "request handler ended early")
    if api_request.why == CLIENT_GONE:
        log.info("request %s: client hung up, aborted", api_request.request_id)
        return Response(status_code=499)
    body = fmt.chat_response(api_request) if api_request.kind == "chat" else fmt.completion_response(api_request)
    return JSONResponse(body, headers=headers)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """The Responses API for text, on the chat path (responses_api.py)."""
    state = state_of(request)
    chat, body, ignored = chat_body(parse_json_object(await read_body(request, state.max_body_bytes)))
    api_request = await state.accept(json.dumps(chat).encode(), request, ChatCompletionRequest)
    headers = ignored_headers(ignored, api_request.request_id)
    shape = ResponseShape(body, api_request.model)
    if api_request.stream:
        return GenerationStream(api_request, _response_events(api_request, shape), headers)
    await while_connected(request.receive, api_request, _drain(api_request), "request handler ended early")
    if api_request.why == CLIENT_GONE:
        return Response(status_code=499)
    gen = api_request.gens[0]
    return JSONResponse(shape.response(gen.text, gen.finish_reason, api_request.usage(), _logprobs(gen, gen.logprobs)),
                        headers=headers)


def _logprobs(gen, scored) -> list | None:
    return (fmt.chat_logprobs(gen, scored) or {}).get("content")


async def _response_events(request: ApiRequest, shape: ResponseShape):
    for event in shape.opening():
        yield _named_sse(event)
    gen, held = request.gens[0], []
    async for _index, out in request.outputs():
        held += out.logprobs  # a token of half a character waits for the text it completes
        if out.text:
            yield _named_sse(shape.delta(out.text, _logprobs(gen, held)))
            held = []
    if request.why == CLIENT_GONE:
        return
    for event in shape.closing(gen.text, gen.finish_reason, request.usage(), _logprobs(gen, gen.logprobs)):
        yield _named_sse(event)


def _named_sse(event: dict) -> bytes:
    return f"event: {event['type']}\n".encode() + fmt.sse(event)


async def _drain(request: ApiRequest) -> None:
    async for _ in request.outputs():
        pass


async def _sse_events(request: ApiRequest):
    chat = request.kind == "chat"
    logprobs = request.sampling.logprobs is not None
    if chat:
        for index in range(len(request.gens)):
            yield fmt.sse(fmt.chat_role_chunk(request, index))
    text_offsets = [0] * len(request.gens)
    echoes = [not chat and gen.request.prompt is not None and gen.request.prompt.echo for gen in request.gens]
    templates = [fmt.ChunkTemplate(request, i) for i in range(len(request.gens))] \
        if fmt.ChunkTemplate.applies(request) and not any(echoes) else None
    async for index, out in request.outputs():  # GenerationStream watches the client
        if echoes[index]:  # the prompt goes first, with the first output (or alone: max_tokens 0)
            echoes[index] = False
            chunk = fmt.completion_echo_chunk(request, index, out)
            text_offsets[index] += len(chunk["choices"][0]["text"])
            yield fmt.sse(chunk)
            continue
        if request.gens[index].request.prompt is not None and request.gens[index].request.prompt.drop_output:
            if out.finish_reason is None:
                continue
            out = Output("", [], finish_reason=out.finish_reason)
        if not out.text and out.finish_reason is None and not (logprobs and out.token_ids):
            continue  # nothing a client can use yet (e.g. half a character)
        if templates is not None and out.finish_reason is None:
            yield templates[index].sse(out.text)
        else:
            yield fmt.sse(fmt.chat_chunk(request, index, out) if chat
                          else fmt.completion_chunk(request, index, out, text_offsets[index]))
        text_offsets[index] += len(out.text)
    if request.why == CLIENT_GONE:
        return
    if request.include_usage:
        yield fmt.sse(fmt.usage_chunk(request))
    yield fmt.sse("[DONE]")


class GenerationStream(StreamingResponse):
    """An SSE response run under edge.while_connected (Starlette skips its own disconnect
    listener from ASGI spec 2.4 on)."""

    def __init__(self, request: ApiRequest, content, headers: dict | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.request = request

    async def __call__(self, scope, receive, send) -> None:
        await while_connected(receive, self.request, self.stream_response(send), "stream ended early")
