"""Request bodies the api accepts (OpenAI field names) and the OpenAI-style error.

Parsing is strict (a wrong type is an error, never coerced); unknown fields are ignored.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict


class ApiError(Exception):
    """A client error: becomes {"error": {...}} with its HTTP status; changes nothing."""

    def __init__(self, status: int, message: str, code: str = "invalid_request",
                 param: str | None = None, type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.headers = headers or {}  # e.g. Retry-After on a 429
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk, only with include_usage

    @pydantic.model_validator(mode="after")
    def _usage_only_if_included(self) -> StreamOptions:
        self.continuous_usage_stats = self.continuous_usage_stats and self.include_usage
        return self


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: EOS, stop_token_ids and stop strings wait until this many tokens
    speculative_decoding: bool = True  # ours: false, no drafts for this request (docs/speculative_decoding.md)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    priority: int = 0
    user: str | None = None
    cache_salt: str | None = None  # vLLM's name: only requests with the same salt share cached prefix blocks
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens, with this many top ones
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs (structured_outputs.py): vLLM's field and its older guided_* ones
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (tool_calls.py)
    tool_call_id: str | None = None  # a tool result's call


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def parse_json_object(raw: bytes | str) -> dict:
    """JSON bytes -> a dict; ApiError(400) for malformed JSON or a body that is not an object."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def parse_body(raw: bytes | str, cls: type[_Body] | None = None) -> _Body:
    """JSON bytes -> a request model (`cls` None: chat if "messages"); ApiError(400) names a bad field."""
    data = parse_json_object(raw)
    if cls is None:
        cls = ChatCompletionRequest if "messages" in data else CompletionRequest
    try:
        return cls.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: pydantic.ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(e), "type": "value_error"}
    loc = [str(p) for p in first.get("loc", ()) if not _is_union_tag(p)]
    field = loc[0] if loc else None
    where = ".".join(loc)
    if first.get("type") == "missing":
        message = f"missing required field '{where}'"
    else:
        message = f"invalid value for '{where}': {first.get('msg')}" if where else str(first.get("msg"))
    return ApiError(400, message, code="invalid_type" if first.get("type") != "missing" else "missing_field",
                    param=field)


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the union member's name in the location ('str', 'list[int]', ...)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)
