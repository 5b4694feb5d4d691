"""OpenAI response shapes for completions and chat completions, whole and as SSE chunks;
`n` choices, each with its index (services/api/choices.py)."""

from __future__ import annotations

import json

from pagedserve.services.api.choices import Choices
from pagedserve.services.api.generation import Generation, Output
from pagedserve.shared.messages import SampledToken


def completion_response(choices: Choices) -> dict:
    body = [{"index": i, "text": gen.text, "logprobs": completion_logprobs(gen, gen.logprobs, 0),
             "finish_reason": gen.finish_reason} for i, gen in enumerate(choices.gens)]
    return _envelope(choices, "text_completion", body, usage=choices.usage())


def chat_response(choices: Choices) -> dict:
    body = [{"index": i, "message": {"role": "assistant", "content": gen.text},
             "logprobs": chat_logprobs(gen, gen.logprobs), "finish_reason": gen.finish_reason}
            for i, gen in enumerate(choices.gens)]
    return _envelope(choices, "chat.completion", body, usage=choices.usage())


def completion_chunk(choices: Choices, index: int, out: Output, text_offset: int) -> dict:
    choice = {"index": index, "text": out.text,
              "logprobs": completion_logprobs(choices.gens[index], out.logprobs, text_offset),
              "finish_reason": out.finish_reason}
    return _envelope(choices, "text_completion", [choice], usage=_chunk_usage(choices))


def chat_role_chunk(choices: Choices, index: int = 0) -> dict:
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return _envelope(choices, "chat.completion.chunk", [choice], usage=_chunk_usage(choices))


def chat_chunk(choices: Choices, index: int, out: Output) -> dict:
    delta = {"content": out.text} if out.text or out.finish_reason is None else {}
    choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(choices.gens[index], out.logprobs),
              "finish_reason": out.finish_reason}
    return _envelope(choices, "chat.completion.chunk", [choice], usage=_chunk_usage(choices))


def usage_chunk(choices: Choices) -> dict:
    kind = "chat.completion.chunk" if choices.prepared.kind == "chat" else "text_completion"
    return _envelope(choices, kind, [], usage=choices.usage())


class ChunkTemplate:
    """The SSE bytes of one choice's plain chunk (new text only: no logprobs, no finish
    reason, no usage figures) cut once per stream around a marker, the text JSON-escaped
    into the gap: byte for byte sse(completion_chunk(...)) or sse(chat_chunk(...)), without
    building and dumping the envelope for every token."""

    _MARKER = "\ue000pagedserve-text\ue000"  # private use: json.dumps leaves it as it is

    def __init__(self, choices: Choices, index: int) -> None:
        out = Output(self._MARKER, [])
        chunk = chat_chunk(choices, index, out) if choices.prepared.kind == "chat" else \
            completion_chunk(choices, index, out, 0)
        self._head, self._tail = sse(chunk).split(json.dumps(self._MARKER, ensure_ascii=False).encode())

    @staticmethod
    def applies(choices: Choices) -> bool:
        return choices.prepared.sampling.logprobs is None and not choices.prepared.continuous_usage

    def sse(self, text: str) -> bytes:
        return self._head + json.dumps(text, ensure_ascii=False).encode() + self._tail


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _chunk_usage(choices: Choices) -> dict | None:
    if choices.prepared.continuous_usage:
        return choices.usage()
    return None


def _envelope(choices: Choices, obj: str, body: list, usage: dict | None) -> dict:
    prepared = choices.prepared
    envelope = {"id": choices.request_id, "object": obj, "created": choices.created, "model": prepared.model,
                "choices": body}
    if usage is not None or prepared.include_usage or not prepared.stream:
        envelope["usage"] = usage
    return envelope


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(gen: Generation, logprobs: list[SampledToken], text_offset: int) -> dict | None:
    if gen.prepared.sampling.logprobs is None:
        return None
    tok = gen.tokenizer
    tokens, token_logprobs, top, offsets = [], [], [], []
    for s in logprobs:
        text = _token_text(tok, s.token_id)
        tokens.append(text)
        token_logprobs.append(s.logprob)
        top.append({_token_text(tok, t): lp for t, lp in (s.top_logprobs or [])} if s.top_logprobs else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(gen: Generation, logprobs: list[SampledToken]) -> dict | None:
    if gen.prepared.sampling.logprobs is None:
        return None
    tok = gen.tokenizer
    content = []
    for s in logprobs:
        text = _token_text(tok, s.token_id)
        top = [{"token": (t_text := _token_text(tok, t)), "logprob": lp, "bytes": list(t_text.encode())}
               for t, lp in (s.top_logprobs or [])]
        content.append({"token": text, "logprob": s.logprob, "bytes": list(text.encode()), "top_logprobs": top})
    return {"content": content}
