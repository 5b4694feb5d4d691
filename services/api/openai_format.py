"""OpenAI response shapes for completions and chat completions, whole and as SSE chunks."""

from __future__ import annotations

import json

from services.api.generation import Generation, Output
from shared.messages import SampledToken


def completion_response(gen: Generation) -> dict:
    choice = {"index": 0, "text": gen.text, "logprobs": completion_logprobs(gen, gen.logprobs, 0),
              "finish_reason": gen.finish_reason}
    return _envelope(gen, "text_completion", [choice], usage=gen.usage())


def chat_response(gen: Generation) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": gen.text},
              "logprobs": chat_logprobs(gen, gen.logprobs), "finish_reason": gen.finish_reason}
    return _envelope(gen, "chat.completion", [choice], usage=gen.usage())


def completion_chunk(gen: Generation, out: Output, text_offset: int) -> dict:
    choice = {"index": 0, "text": out.text, "logprobs": completion_logprobs(gen, out.logprobs, text_offset),
              "finish_reason": out.finish_reason}
    return _envelope(gen, "text_completion", [choice], usage=_chunk_usage(gen))


def chat_role_chunk(gen: Generation) -> dict:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return _envelope(gen, "chat.completion.chunk", [choice], usage=_chunk_usage(gen))


def chat_chunk(gen: Generation, out: Output) -> dict:
    delta = {"content": out.text} if out.text or out.finish_reason is None else {}
    choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(gen, out.logprobs),
              "finish_reason": out.finish_reason}
    return _envelope(gen, "chat.completion.chunk", [choice], usage=_chunk_usage(gen))


def usage_chunk(gen: Generation) -> dict:
    kind = "chat.completion.chunk" if gen.prepared.kind == "chat" else "text_completion"
    return _envelope(gen, kind, [], usage=gen.usage())


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _chunk_usage(gen: Generation) -> dict | None:
    if gen.prepared.continuous_usage:
        return gen.usage()
    return None


def _envelope(gen: Generation, obj: str, choices: list, usage: dict | None) -> dict:
    body = {"id": gen.request_id, "object": obj, "created": gen.created, "model": gen.prepared.model,
            "choices": choices}
    if usage is not None or gen.prepared.include_usage or not gen.prepared.stream:
        body["usage"] = usage
    return body


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
