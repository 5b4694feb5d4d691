"""A model's chat template rendered with jinja2 alone, as transformers' apply_chat_template
renders it (same sandbox, options, globals and filters), so the api need not import transformers.

Mirrors transformers 5.x `utils/chat_template_utils.py`: an immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, a `{% generation %}` tag that renders its body, `tojson` without
HTML escaping, `raise_exception`, `strftime_now`, a `dict` and a `namespace` that refuse dunders.
Messages lose their None-valued keys and have reasoning copied under `reasoning_content` and
`thinking`; everything the template sees is plain JSON data.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def pick_template(chat_template: str | dict | None, tools: list | None) -> str:
    """The template a model's (possibly named) templates use for a request, as transformers picks it."""
    if isinstance(chat_template, dict):
        if tools is not None and "tool_use" in chat_template:
            return chat_template["tool_use"]
        if "default" in chat_template:
            return chat_template["default"]
        raise ValueError(f"this model has several chat templates and no default: {sorted(chat_template)}")
    if not chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    return chat_template


def render_chat(chat_template: str | dict | None, messages: list[dict], tools: list[dict] | None,
                special_tokens: dict[str, str]) -> str:
    """The prompt text for `messages`, ending with the assistant turn's header."""
    template = _compile(pick_template(chat_template, tools))
    chat = _alias_reasoning([{k: v for k, v in _plain(m).items() if v is not None} for m in messages])
    return template.render(messages=chat, tools=_plain(tools), documents=None, add_generation_prompt=True,
                           **_plain(special_tokens))


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks: rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` in a template, without attribute access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names (no path to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore names: {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value):
    """JSON data only: a template never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
