"""Strict at the door of the OpenAI routes: a field OpenAI defines that this server does not
implement, given a value that asks for something, is a 400 naming it, never silently ignored.

A field neither OpenAI's nor ours (another server's extension, a typo) is accepted and ignored,
as vLLM does (its request models allow extras and log them): check_fields returns its name, the
route logs it and answers with it in the `pagedserve-ignored-fields` header.

A field the route's request model (protocol.py) declares is implemented there and checked by
inputs.prepare, so it never reaches this table: as structured outputs and tools land
(response_format, tools, tool_choice, parallel_tool_calls: issue 31) they leave this check by
being declared, with their own validation.
"""

from __future__ import annotations

import logging

from pagedserve.services.api.protocol import ApiError

log = logging.getLogger("pagedserve.api")

_ANY = object()  # a field whose every value is honoured as it is (a hint or a label)

# field -> the values that ask for nothing beyond what this server does (None: null or absent)
_CHAT = {
    "audio": (None,),
    "function_call": (None, "none"),
    "functions": (None, []),
    "metadata": _ANY,  # labels for stored completions; `store` itself is refused
    "modalities": (None, ["text"]),
    "parallel_tool_calls": _ANY,  # meaningless without tools (issue 31)
    "prediction": (None,),
    "prompt_cache_key": _ANY,  # a routing hint; prefix caching needs none
    "reasoning_effort": (None,),
    "response_format": (None, {"type": "text"}),  # issue 31
    "safety_identifier": _ANY,
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "tool_choice": (None, "none"),  # issue 31
    "tools": (None, []),  # issue 31
    "verbosity": (None, "medium"),
    "web_search_options": (None,),
}


IGNORED_HEADER = "pagedserve-ignored-fields"


def ignored_headers(ignored: list[str], request_id: str) -> dict[str, str]:
    """The response headers naming the fields a request's route ignored (none: no header); logged."""
    if not ignored:
        return {}
    log.warning("request %s: fields ignored (not served here): %s", request_id, ", ".join(ignored))
    return {IGNORED_HEADER: ",".join(ignored)}


def check_fields(data: dict, cls) -> list[str]:
    """400 for an OpenAI field `cls` does not declare whose value asks for something; 400 for
    stream_options without stream (OpenAI's own rule). Returns the fields it ignores, sorted."""
    table = _CHAT if "messages" in cls.model_fields else {}  # /v1/completions declares all of its fields
    for name, honoured in table.items():
        if name in cls.model_fields or name not in data or honoured is _ANY:
            continue
        if data[name] not in honoured:
            raise ApiError(400, f"{name} is not supported by this server (got {data[name]!r})", param=name,
                           code="unsupported")
    if data.get("stream_options") is not None and data.get("stream") is not True:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return sorted(name for name in data if name not in cls.model_fields and name not in table)

