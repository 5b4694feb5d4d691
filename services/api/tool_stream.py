"""A chat stream with tools (tool_calls.py): content as it comes up to where a tool call starts;
each call, once its choice ends, as one `tool_calls` delta (id, name, whole arguments) that the
openai client assembles as it does OpenAI's; then the finish ("tool_calls" when it called any)."""

from __future__ import annotations

from pagedserve.services.api import openai_format as fmt
from pagedserve.services.api.edge import CLIENT_GONE
from pagedserve.services.api.generation import Output
from pagedserve.services.api.request import ApiRequest
from pagedserve.services.api.tool_calls import ToolView


async def tool_events(request: ApiRequest):
    views = [ToolView(request.tool_use) for _ in request.gens]
    for index in range(len(request.gens)):
        yield fmt.sse(fmt.chat_role_chunk(request, index))
    async for index, out in request.outputs():
        content, calls, finish = views[index].step(request.gens[index].text, out.finish_reason)
        if content:
            yield fmt.sse(_chunk(request, index, {"content": content}))
        for k, call in enumerate(calls):
            yield fmt.sse(_chunk(request, index, {"tool_calls": [{"index": k, **call}]}))
        if finish is not None:
            yield fmt.sse(_chunk(request, index, {}, finish))
    if request.why == CLIENT_GONE:
        return
    if request.include_usage:
        yield fmt.sse(fmt.usage_chunk(request))
    yield fmt.sse("[DONE]")


def _chunk(request: ApiRequest, index: int, delta: dict, finish_reason: str | None = None) -> dict:
    chunk = fmt.chat_chunk(request, index, Output("", [], finish_reason=finish_reason))
    chunk["choices"][0]["delta"] = delta
    return chunk
