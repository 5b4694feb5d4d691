"""What a request asks about its own prompt: OpenAI's `echo` (completions: the prompt before each
choice's text, with its tokens' logprobs when `logprobs` is set; `max_tokens: 0` scores the
prompt alone) and vLLM's `prompt_logprobs` (each prompt token's logprob and top ones).

The worker computes prompt logprobs as it prefills (gpu_worker/sampling/prompt_logprobs.py):
a request that wants them is salted apart from the prefix cache, so every prompt token is
computed, and it takes one sequence (n = 1), since n > 1 prefills under the group's id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pagedserve.services.api.protocol import ApiError, CompletionRequest

MAX_PROMPT_LOGPROBS = 20


@dataclass
class PromptEcho:
    echo: bool  # completions: the prompt before each choice's text
    text: str  # the prompt as the choice echoes it
    prompt_logprobs: int | None  # vLLM's field: report them, with this many top ones
    num_top: int | None  # top logprobs per prompt token the worker computes; None: none
    drop_output: bool  # max_tokens 0: the one token the engine samples is not reported


def prompt_echo(body, prompt_ids: list[int], logprobs: int | None, tokenizer) -> PromptEcho | None:
    """None when the request asks nothing about its prompt; ApiError for what cannot be served."""
    echo = isinstance(body, CompletionRequest) and body.echo
    wanted = body.prompt_logprobs
    if wanted is not None and not 0 <= wanted <= MAX_PROMPT_LOGPROBS:
        raise ApiError(400, f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got {wanted}",
                       param="prompt_logprobs")
    if not echo and wanted is None:
        return None
    num_top = max(wanted or 0, logprobs) if echo and logprobs is not None else wanted
    if num_top is not None and body.n > 1:
        raise ApiError(400, "prompt logprobs (echo with logprobs, prompt_logprobs) take n = 1", param="n")
    prompt = body.prompt[0] if echo and isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) \
        else getattr(body, "prompt", "")
    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return PromptEcho(echo=echo, text=text, prompt_logprobs=wanted, num_top=num_top,
                      drop_output=echo and body.max_tokens == 0)


def isolated_salt(salt: str) -> str:
    """A cache salt no other request has: every prompt token is computed, none read from the cache."""
    return f"{salt}/prompt-logprobs-{uuid.uuid4().hex}"


def echoed_logprobs(request, gen, token_text, top_of) -> dict:
    """The prompt's part of a completion choice's logprobs (the first token has none)."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for i, token_id in enumerate(request.prompt_token_ids):
        text = token_text(gen.tokenizer, token_id)
        scored = gen.prompt_logprobs.get(i)
        tokens.append(text)
        token_logprobs.append(scored.logprob if scored else None)
        top.append(None if scored is None else top_of(gen.tokenizer, scored, gen.sampling.logprobs))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(request, gen, token_text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank, decoded_token}}
    with the prompt's token (its rank: how many tokens are at least as likely) and its top ones."""
    out: list[dict | None] = []
    k = request.prompt.prompt_logprobs or 0
    for i, token_id in enumerate(request.prompt_token_ids):
        scored = gen.prompt_logprobs.get(i)
        if scored is None:
            out.append(None)
            continue
        entry = {str(token_id): {"logprob": scored.logprob, "rank": gen.prompt_ranks.get(i),
                                 "decoded_token": token_text(gen.tokenizer, token_id)}}
        for rank, (t, lp) in enumerate((scored.top_logprobs or [])[:k], start=1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": token_text(gen.tokenizer, t)})
            if t == token_id:  # as vLLM: among the top ones, its place there (equal but for ties)
                entry[str(t)]["rank"] = rank
        out.append(entry)
    return out
