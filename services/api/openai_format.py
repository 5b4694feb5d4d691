"""OpenAI response shapes for completions and chat completions, whole and as SSE chunks;
`n` choices, each with its index (services/api/request.py)."""

from __future__ import annotations

import json

from pagedserve.services.api.echo import echoed_logprobs, vllm_prompt_logprobs
from pagedserve.services.api.generation import Generation, Output
from pagedserve.services.api.request import ApiRequest
from pagedserve.services.api.tool_calls import assistant_message
from pagedserve.shared.messages import SampledToken

MIN_LOGPROB = -9999.0  # OpenAI's floor for a reported logprob


def completion_response(request: ApiRequest) -> dict:
    body = [_completion_choice(i, gen) for i, gen in enumerate(request.gens)]
    return _envelope(request, "text_completion", body, usage=request.usage())


def _completion_choice(index: int, gen: Generation) -> dict:
    """A whole choice; echo puts the prompt (and its tokens' logprobs) before the text (echo.py)."""
    prompt = gen.request.prompt
    drop = prompt is not None and prompt.drop_output
    text, logprobs = ("", []) if drop else (gen.text, gen.logprobs)
    offset = len(prompt.text) if prompt is not None and prompt.echo else 0
    scored = completion_logprobs(gen, logprobs, offset)
    if prompt is not None and prompt.echo:
        text = prompt.text + text
        if scored is not None:
            echoed = echoed_logprobs(gen.request, gen, _token_text, completion_top)
            scored = {key: echoed[key] + scored[key] for key in scored}
    choice = {"index": index, "text": text, "logprobs": scored, "finish_reason": gen.finish_reason,
              "prompt_logprobs": None}  # vLLM's field: null unless asked
    if prompt is not None and prompt.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(gen.request, gen, _token_text)
    return choice


def chat_response(request: ApiRequest) -> dict:
    body = [{"index": i, "message": message, "logprobs": chat_logprobs(gen, gen.logprobs), "finish_reason": finish}
            for i, gen in enumerate(request.gens)
            for message, finish in [assistant_message(gen.text, gen.finish_reason, request.tool_use)]]
    envelope = _envelope(request, "chat.completion", body, usage=request.usage())
    envelope["prompt_logprobs"] = None  # vLLM's, beside the choices: null unless asked
    if request.prompt is not None and request.prompt.prompt_logprobs is not None:
        envelope["prompt_logprobs"] = vllm_prompt_logprobs(request, request.gens[0], _token_text)
    return envelope


def completion_chunk(request: ApiRequest, index: int, out: Output, text_offset: int) -> dict:
    choice = {"index": index, "text": out.text,
              "logprobs": completion_logprobs(request.gens[index], out.logprobs, text_offset),
              "finish_reason": out.finish_reason}
    return _envelope(request, "text_completion", [choice], usage=_chunk_usage(request))


def completion_echo_chunk(request: ApiRequest, index: int, out: Output) -> dict:
    """A streamed choice's first chunk under echo: its prompt (and the prompt tokens' logprobs)
    before the first text, as vLLM streams it; max_tokens 0 (drop_output): the prompt alone."""
    gen = request.gens[index]
    prompt = gen.request.prompt
    text, logprobs = ("", []) if prompt.drop_output else (out.text, out.logprobs)
    scored = completion_logprobs(gen, logprobs, len(prompt.text))
    if scored is not None:
        echoed = echoed_logprobs(gen.request, gen, _token_text, completion_top)
        scored = {key: echoed[key] + scored[key] for key in scored}
    choice = {"index": index, "text": prompt.text + text, "logprobs": scored, "finish_reason": out.finish_reason}
    return _envelope(request, "text_completion", [choice], usage=_chunk_usage(request))


def chat_role_chunk(request: ApiRequest, index: int = 0) -> dict:
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return _envelope(request, "chat.completion.chunk", [choice], usage=_chunk_usage(request))


def chat_chunk(request: ApiRequest, index: int, out: Output) -> dict:
    delta = {"content": out.text}  # "" on a finish without text: content stays a string, as vLLM sends it
    choice = {"index": index, "delta": delta, "logprobs": chat_logprobs(request.gens[index], out.logprobs),
              "finish_reason": out.finish_reason}
    return _envelope(request, "chat.completion.chunk", [choice], usage=_chunk_usage(request))


def usage_chunk(request: ApiRequest) -> dict:
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    return _envelope(request, kind, [], usage=request.usage())


class ChunkTemplate:
    """The SSE bytes of one choice's plain chunk (new text only: no logprobs, no finish
    reason, no usage figures) cut once per stream around a marker, the text JSON-escaped
    into the gap: byte for byte sse(completion_chunk(...)) or sse(chat_chunk(...)), without
    building and dumping the envelope for every token."""

    _MARKER = "\ue000pagedserve-text\ue000"  # private use: json.dumps leaves it as it is

    def __init__(self, request: ApiRequest, index: int) -> None:
        out = Output(self._MARKER, [])
        chunk = chat_chunk(request, index, out) if request.kind == "chat" else \
            completion_chunk(request, index, out, 0)
        self._head, self._tail = sse(chunk).split(json.dumps(self._MARKER, ensure_ascii=False).encode())

    @staticmethod
    def applies(request: ApiRequest) -> bool:
        return request.sampling.logprobs is None and not request.continuous_usage

    def sse(self, text: str) -> bytes:
        return self._head + json.dumps(text, ensure_ascii=False).encode() + self._tail


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _chunk_usage(request: ApiRequest) -> dict | None:
    if request.continuous_usage:
        return request.usage()
    return None


def _envelope(request: ApiRequest, obj: str, body: list, usage: dict | None) -> dict:
    envelope = {"id": request.request_id, "object": obj, "created": request.created, "model": request.model,
                "choices": body}
    if usage is not None or request.include_usage or not request.stream:
        envelope["usage"] = usage
    return envelope


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(gen: Generation, logprobs: list[SampledToken], text_offset: int) -> dict | None:
    if gen.sampling.logprobs is None:
        return None
    tok = gen.tokenizer
    tokens, token_logprobs, top, offsets = [], [], [], []
    for s in logprobs:
        text = _token_text(tok, s.token_id)
        tokens.append(text)
        token_logprobs.append(floor(s.logprob))
        top.append(completion_top(tok, s, gen.sampling.logprobs))
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def completion_top(tokenizer, scored: SampledToken, k: int) -> dict[str, float]:
    """A completion token's top_logprobs as OpenAI gives them: the k most likely and the chosen
    one (k or k + 1 entries; logprobs 0: the chosen alone)."""
    top = {_token_text(tokenizer, t): floor(lp) for t, lp in (scored.top_logprobs or [])[:k]}
    top.setdefault(_token_text(tokenizer, scored.token_id), floor(scored.logprob))
    return top


def floor(logprob: float) -> float:
    """A logprob as OpenAI reports it: at least -9999.0 (a token a grammar or logit_bias masks
    has -inf, which JSON cannot carry)."""
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(gen: Generation, logprobs: list[SampledToken]) -> dict | None:
    if gen.sampling.logprobs is None:
        return None
    tok = gen.tokenizer
    content = []
    for s in logprobs:
        text = _token_text(tok, s.token_id)
        top = [{"token": (t_text := _token_text(tok, t)), "logprob": floor(lp), "bytes": list(t_text.encode())}
               for t, lp in (s.top_logprobs or [])]
        content.append({"token": text, "logprob": floor(s.logprob), "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}
