"""Structured outputs at the edge: `response_format`, vLLM's `structured_outputs` and its older
`guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` -> one GuidedDecoding, checked
here once (a 400 naming the field and the problem), compiled by the worker (sampling/grammar.py).

Checked: a JSON schema against its metaschema (`jsonschema`) and for keywords the grammar engine
cannot enforce; every spec by xgrammar's own parser, which the worker's compiler runs too.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.services.api.protocol import ApiError
from pagedserve.shared.messages import GuidedDecoding

# keywords xgrammar's JSON schema converter does not enforce: refused rather than silently ignored
UNSUPPORTED_KEYWORDS = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentSchemas",
    "dependentRequired", "dependencies", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
    "multipleOf", "$dynamicRef", "$dynamicAnchor",
})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems")
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
BODY_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


def guided_decoding(body) -> GuidedDecoding | None:
    """The body's one structured-output request (None: free text); ApiError(400) if bad or several."""
    asked: list[tuple[str, GuidedDecoding]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        guided = _response_format(response_format)
        if guided is not None:
            asked.append(("response_format", guided))
    options = body.structured_outputs or {}
    if not isinstance(options, dict):
        raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
    for key, value in options.items():
        if key in _VLLM_KINDS and value not in (None, False):
            asked.append((f"structured_outputs.{key}", _vllm(key, value, f"structured_outputs.{key}")))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            asked.append((f"guided_{key}", _vllm(key, value, f"guided_{key}")))
    if len(asked) > 1:
        raise ApiError(400, f"ask for one structured output, got {', '.join(name for name, _ in asked)}",
                       param=asked[1][0].split(".")[0])
    if asked and body.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be used with a structured output: the output ends where the "
                       "grammar does", param="ignore_eos")
    return asked[0][1] if asked else None


def json_schema_guide(schema: Any, param: str) -> GuidedDecoding:
    """A JSON schema (object) -> GuidedDecoding("json"), checked."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param} must be a JSON schema object, got {type(schema).__name__}", param=_field(param))
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ApiError(400, f"{param} is not a valid JSON schema: {e.message}", param=_field(param)) from None
    path = unsupported_keyword(schema)
    if path is not None:
        raise ApiError(400, f"{param}: the keyword '{path}' is not supported in structured outputs",
                       param=_field(param), code="unsupported")
    spec = json.dumps(schema, ensure_ascii=False)  # key order kept: xgrammar emits properties in it
    _check_with_xgrammar("json", spec, param)
    return GuidedDecoding("json", spec)


def structural_tag_guide(tag: dict, param: str) -> GuidedDecoding:
    """xgrammar's structural tag ({"type": "structural_tag", "format": {...}}) -> GuidedDecoding, checked:
    free text with tagged, constrained regions (tool calls in "auto" with strict functions)."""
    spec = json.dumps(tag, ensure_ascii=False)
    _check_with_xgrammar("structural_tag", spec, param)
    return GuidedDecoding("structural_tag", spec)


def unsupported_keyword(schema: Any, where: str = "") -> str | None:
    """The path of the first unsupported keyword in a schema (None: all supported)."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNSUPPORTED_KEYWORDS:
            return f"{where}{key}"
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            if (found := unsupported_keyword(sub, f"{where}{key}.{name}.")) is not None:
                return found
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            if (found := unsupported_keyword(sub, f"{where}{key}[{i}].")) is not None:
                return found
    for key in _SCHEMA_ONE:
        if (found := unsupported_keyword(schema.get(key), f"{where}{key}.")) is not None:
            return found
    return None


def _response_format(response_format: dict) -> GuidedDecoding | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, "response_format.json_schema must be an object with a 'schema'",
                           param="response_format")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ApiError(400, "response_format.json_schema.strict must be a boolean", param="response_format")
        return json_schema_guide(spec["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        if not isinstance(response_format.get("format"), dict):
            raise ApiError(400, "response_format.format must be a structural tag format object",
                           param="response_format")
        return structural_tag_guide(response_format, "response_format")
    raise ApiError(400, "response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                   f"got {kind!r}", param="response_format")


def _vllm(kind: str, value: Any, param: str) -> GuidedDecoding:
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ApiError(400, f"{param} is not valid JSON: {e}", param=_field(param)) from None
        return json_schema_guide(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{param} must be a non-empty list of non-empty strings", param=_field(param))
        spec = "root ::= " + " | ".join(_ebnf_literal(c) for c in value)
        return GuidedDecoding("grammar", spec)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=_field(param))
    _check_with_xgrammar(kind, value, param)
    return GuidedDecoding(kind, value)


def _field(param: str) -> str:
    """The request's field a nested name is in: "tools[0].function.parameters" -> "tools"."""
    return param.split(".")[0].split("[")[0]


def _ebnf_literal(text: str) -> str:
    """A string as an EBNF literal: JSON's escapes are xgrammar's."""
    return json.dumps(text, ensure_ascii=False)


def _check_with_xgrammar(kind: str, spec: str, param: str) -> None:
    import xgrammar as xgr

    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        else:
            xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        message = message.split(": ", 1)[1] if message.startswith("[") and ": " in message else message
        what = {"json": "JSON schema", "regex": "regular expression", "structural_tag": "structural tag"}.get(
            kind, "grammar")
        raise ApiError(400, f"{param}: invalid {what}: {message}", param=_field(param)) from None
