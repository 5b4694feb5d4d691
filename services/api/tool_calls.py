"""Tool calling on chat: `tools` and `tool_choice` checked once, the tools put into the prompt, and
the model's calls parsed out of its text into `message.tool_calls`.

The call format is hermes (Qwen2.5/Qwen3's templates, vLLM's `--tool-call-parser hermes`):
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A template that takes `tools` renders
them itself; for one that does not, a system message describes them and the format (as llama.cpp's
server does for generic models). `tool_choice` "auto" parses what the model wrote; "required" and
a named function constrain the output with a JSON schema (as vLLM): a JSON array of
`{"name", "arguments"}` calls, or the named function's `{"name", "arguments"}` object.
`parallel_tool_calls` false allows one call at most: the array's maxItems, and the first call
parsed in "auto" (as OpenAI; vLLM keeps the first call too). In "auto", a function with `strict:
true` makes every `<tool_call>` the model opens a constrained one (xgrammar's triggered tags, as
vLLM and SGLang do): free text until `<tool_call>`, then one of the functions' names, the
arguments its parameters schema allows (strict functions) or any JSON object, and the closing tag.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field

from pagedserve.services.api.protocol import ApiError
from pagedserve.services.api.structured_outputs import json_schema_guide, structural_tag_guide
from pagedserve.shared.messages import GuidedDecoding

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
START = "<tool_call>"


@dataclass
class ToolUse:
    """What a request asked of its tools; mode "auto", "required" or "named"."""

    mode: str
    functions: list[dict] = field(default_factory=list)  # OpenAI's {"name", "description", "parameters"}
    parallel: bool = True  # more than one call allowed (OpenAI's parallel_tool_calls, default true)


def tool_use(body) -> tuple[ToolUse | None, GuidedDecoding | None]:
    """(how to read the output, the constraint for it); (None, None) without tools or tool_choice "none"."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    strict = [tool["function"].get("strict") is True for tool in tools]
    names = [f["name"] for f in functions]
    parallel = body.parallel_tool_calls is not False
    if choice in (None, "auto"):
        return ToolUse("auto", functions, parallel), _strict_calls(functions, strict, parallel) if any(strict) else None
    if choice == "none":
        return None, None
    if choice == "required":
        anyof = [_call_schema(f, i) for i, f in enumerate(functions)]
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": anyof}}
        if not parallel:
            calls["maxItems"] = 1
        return ToolUse("required", functions, parallel), json_schema_guide(_rooted(calls, functions), "tools")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                       "'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
    function = functions[names.index(name)]
    return ToolUse("named", [function]), json_schema_guide(_rooted(_call_schema(function, 0), [function]), "tools")


def _function(tool, index: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(400, f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"tools[{index}].function.name must be 1-64 letters, digits, '_', '.', ':' or '-'",
                       param="tools")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise ApiError(400, f"tools[{index}].function.strict must be a boolean", param="tools")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    json_schema_guide(parameters, f"tools[{index}].function.parameters")
    return {"name": name, "description": function.get("description") or "", "parameters": parameters}


def _call_schema(function: dict, i: int) -> dict:
    arguments = {"$ref": f"#/$defs/f{i}"} if _refers(function["parameters"]) else function["parameters"]
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _rooted(schema: dict, functions: list[dict]) -> dict:
    """A parameters schema's local $refs ("#/$defs/...") point from its own root: one that has them
    moves under the wrapping schema's $defs, its pointers rebased there (xgrammar follows no array index)."""
    defs = {f"f{i}": _rebased(f["parameters"], f"#/$defs/f{i}") for i, f in enumerate(functions)
            if _refers(f["parameters"])}
    return {**schema, "$defs": defs} if defs else schema


def _refers(node) -> bool:
    if isinstance(node, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#")) or _refers(v) for k, v in node.items())
    return isinstance(node, list) and any(_refers(v) for v in node)


def _rebased(node, root: str):
    if isinstance(node, dict):
        return {k: root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, root)
                for k, v in node.items()}
    return [_rebased(v, root) for v in node] if isinstance(node, list) else node


def _strict_calls(functions: list[dict], strict: list[bool], parallel: bool) -> GuidedDecoding:
    """"auto" with strict functions: any text, and each call the model opens constrained (in the format
    the prompt shows) to a function's name and arguments."""
    any_object = {"type": "object", "additionalProperties": True}
    tags = [{"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(f["name"])}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": f["parameters"] if s else any_object,
                         "max_whitespace_cnt": 1},
             "end": "}\n</tool_call>"} for f, s in zip(functions, strict, strict=True)]
    return structural_tag_guide({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [START], "tags": tags, "stop_after_first": not parallel}}, "tools")


def template_messages(messages: list[dict], body, use: ToolUse | None, native: bool) -> tuple[list[dict], list | None]:
    """Chat messages (role, content) plus the body's tool calls and tool results -> (messages, tools)
    for the chat template: its own tool handling if it has one (native), else text it renders as any other."""
    out = []
    for message, raw in zip(messages, body.messages, strict=True):
        message = dict(message)
        calls = raw.tool_calls or []
        if native:
            if calls:
                message["tool_calls"] = [_template_call(c) for c in calls]
            if raw.tool_call_id is not None:
                message["tool_call_id"] = raw.tool_call_id
        elif calls:
            rendered = "\n".join(f"{START}\n{json.dumps(_template_call(c)['function'], ensure_ascii=False)}\n"
                                 "</tool_call>" for c in calls)
            message["content"] = f"{message['content']}\n{rendered}".lstrip("\n")
        out.append(message)
    if use is None:
        return out, None
    if native:
        return out, [{"type": "function", "function": f} for f in use.functions]
    system = _system_prompt(use)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _template_call(call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ApiError(400, "an assistant message's tool_calls[].function.arguments is not JSON",
                       param="messages") from None
    name = function.get("name")
    return {"type": "function", "function": {"name": name if isinstance(name, str) else "", "arguments": arguments}}


def _system_prompt(use: ToolUse) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in use.functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>"
            "\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def parse(text: str, use: ToolUse, ids_from: str | None = None) -> tuple[str | None, list[dict]]:
    """The model's text -> (content, OpenAI tool_calls); no call found: (text, []). ids_from: the
    calls' ids derive from it (the same on every read of a record), else they are random."""
    if use.mode == "auto":
        head, start, _ = text.partition(START)
        if not start:
            return text, []
        found = [_loads(m.group(1)) for m in _CALL.finditer(text)]
        raw = [c for c in found if isinstance(c, dict) and isinstance(c.get("name"), str)]
        if not raw:
            return text, []
        content = head.strip() or None
    else:
        value = _loads(text)
        raw = value if use.mode == "required" and isinstance(value, list) else [value]
        raw = [c for c in raw if isinstance(c, dict) and isinstance(c.get("name"), str)]
        if not raw:
            return text, []
        content = None
    if not use.parallel:
        raw = raw[:1]
    calls = [{"id": _call_id(ids_from, k), "type": "function",
              "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", c.get("parameters", {})),
                                                                       ensure_ascii=False)}} for k, c in enumerate(raw)]
    return content, calls


def assistant_message(text: str, finish_reason: str | None, use: ToolUse | None) -> tuple[dict, str | None]:
    """A finished choice's (message, finish_reason): "tool_calls" when it called any."""
    if use is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse(text, use)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def _call_id(ids_from: str | None, k: int) -> str:
    if ids_from is None:
        return f"call_{uuid.uuid4().hex[:24]}"
    return f"call_{hashlib.sha256(f'{ids_from}/{k}'.encode()).hexdigest()[:24]}"


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def held_back(text: str) -> int:
    """Where streamed content must stop (auto): at a tool call's start, or a partial one at the end."""
    at = text.find(START)
    if at >= 0:
        return at
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-k:]):
            return len(text) - k
    return len(text)


_PARSED_AT = ("stop", "length")  # an aborted or failed output is reported as it is


@dataclass
class ToolView:
    """One choice's output as a streaming client of a tool-using request sees it: content up to where a
    call starts (auto; none in required and named), then at the finish its calls, parsed."""

    use: ToolUse
    ids_from: str | None = None
    sent: int = 0  # characters of the text already given as content

    def visible(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """(content so far, calls, finish reason: "tool_calls" when it called any)."""
        if finish_reason not in _PARSED_AT:
            limit = held_back(text) if self.use.mode == "auto" else 0
            return (text, [], finish_reason) if finish_reason is not None else (text[:limit], [], None)
        _, calls = parse(text, self.use, self.ids_from)
        if not calls:
            return text, [], finish_reason
        return (text[:held_back(text)] if self.use.mode == "auto" else ""), calls, "tool_calls"

    def step(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        content, calls, finish = self.visible(text, finish_reason)
        new, self.sent = content[self.sent:], max(self.sent, len(content))
        return new, calls, finish
