"""OpenAI's Responses API for text (POST /v1/responses): the body becomes a chat completion
(instructions as the system message, `input` as the conversation) and runs on the chat path;
the answer is a `response` object, or its SSE events (response.created ... response.completed).

What it does not serve (previous_response_id, tools, reasoning effort, background, ...) is a 400
naming the field; replayed reasoning items in `input` are dropped (the model has none to show). `store` (true by OpenAI's default) is accepted and nothing is stored, as vLLM does
without --enable-store: the answer says "store": false.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict

from pagedserve.services.api.protocol import ApiError

_LOGPROBS = "message.output_text.logprobs"
_SAMPLING = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
             "speculative_decoding")

# field -> values that ask for nothing beyond text in, text out
_REFUSED = {"previous_response_id": (None,), "conversation": (None,), "tools": (None, []),
            "tool_choice": (None, "none", "auto"), "reasoning": (None, {}, {"effort": "none"}, {"effort": None}),
            "background": (None, False), "include": (None, [], [_LOGPROBS]), "prompt": (None,), "truncation": (None, "disabled"),
            "max_tool_calls": (None,)}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    user: str | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None


def chat_body(data: dict) -> tuple[dict, ResponsesRequest, list[str]]:
    """A Responses body (parsed JSON) -> the chat body it asks for, the request, the fields it ignores."""
    for name, honoured in _REFUSED.items():
        if name in data and data[name] not in honoured:
            raise ApiError(400, f"{name} is not supported by this server's Responses API", param=name,
                           code="unsupported")
    try:
        body = ResponsesRequest.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first.get("loc") else None
        raise ApiError(400, f"invalid value for '{field}': {first['msg']}", param=field, code="invalid_type") from None
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise ApiError(400, f"text.format {fmt.get('type')!r} is not supported (text only)", param="text",
                       code="unsupported")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += [{"role": "user", "content": body.input}] if isinstance(body.input, str) else \
        [_message(item, i) for i, item in enumerate(body.input) if item.get("type") != "reasoning"]
    chat = {"messages": messages, "stream": body.stream, **{k: data[k] for k in _SAMPLING if k in data}}
    if _LOGPROBS in (body.include or []):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    for ours, theirs in (("model", "model"), ("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("user", "user")):
        if getattr(body, theirs) is not None:
            chat[ours] = getattr(body, theirs)
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    known = (*ResponsesRequest.model_fields, *_REFUSED, *_SAMPLING, "store")
    return chat, body, sorted(name for name in data if name not in known)


def _message(item: dict, index: int) -> dict:
    if item.get("type", "message") != "message" or "role" not in item:
        raise ApiError(400, f"input[{index}]: only messages are supported, got type {item.get('type')!r}",
                       param="input", code="unsupported")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"input[{index}].content: only text parts are supported, got {kind!r}",
                               param="input", code="unsupported")
            parts.append({"type": "text", "text": part.get("text", "")})
        content = parts
    return {"role": item["role"], "content": content}


class ResponseShape:
    """The response object and its stream events for one chat request (one choice)."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.body, self.model = body, model
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.seq = -1

    def response(self, text: str | None, finish_reason: str | None, usage: dict | None,
                 logprobs: list | None = None) -> dict:
        """text None: in progress (no output yet)."""
        incomplete = finish_reason == "length"
        status = "in_progress" if text is None else "incomplete" if incomplete else "completed"
        output = [] if text is None else [self.item(text, "incomplete" if incomplete else "completed", logprobs)]
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "temperature": b.temperature, "top_p": b.top_p, "top_logprobs": b.top_logprobs, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": [], "store": False, "text": {"format": {"type": "text"}}, "metadata": b.metadata or {}, "user": b.user,
                "usage": self.usage(usage) if usage else None}

    def item(self, text: str, status: str, logprobs: list | None = None) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [self.part(text, logprobs)]}

    @staticmethod
    def part(text: str, logprobs: list | None = None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    @staticmethod
    def usage(usage: dict) -> dict:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def opening(self) -> list[dict]:
        at = {"item_id": self.item_id, "output_index": 0}
        return [self.event("response.created", response=self.response(None, None, None)),
                self.event("response.in_progress", response=self.response(None, None, None)),
                self.event("response.output_item.added", output_index=0,
                           item={**self.item("", "in_progress"), "content": []}),
                self.event("response.content_part.added", **at, content_index=0, part=self.part(""))]

    def delta(self, text: str, logprobs: list | None = None) -> dict:
        return self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                          delta=text, logprobs=logprobs or [])

    def closing(self, text: str, finish_reason: str | None, usage: dict, logprobs: list | None = None) -> list[dict]:
        at = {"item_id": self.item_id, "output_index": 0}
        done = self.response(text, finish_reason, usage, logprobs)
        final = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return [self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=logprobs or []),
                self.event("response.content_part.done", **at, content_index=0, part=self.part(text, logprobs)),
                self.event("response.output_item.done", output_index=0, item=done["output"][0]),
                self.event(final, response=done)]
