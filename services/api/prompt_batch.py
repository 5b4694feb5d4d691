"""A list of prompts on /v1/completions: one ApiRequest per prompt, submitted together (so they
share the scheduler's steps), answered as one response whose choice `p * n + i` is choice i of
prompt p, as OpenAI indexes them.

It stands where openai_routes and openai_format expect an ApiRequest: the first prompt's fields,
`gens` flattened in choice order, `outputs()` merged, usage summed over the prompts.

A request that scores its prompt (echo with logprobs, prompt_logprobs) with n > 1 becomes n
copies of each prompt, each n = 1 with seed + i: the worker scores a prompt for one sequence,
and child i of n samples as a lone request with seed + i (shared/parallel_sampling.py), so
the choices are the same. Usage counts each prompt once, as for n > 1.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.services.api.generation import Output
from pagedserve.services.api.protocol import ApiError, CompletionRequest
from pagedserve.services.api.request import ApiRequest, merge

MAX_PROMPTS = 256  # prompts in one request (each with its n choices)


def prompt_copies(body: CompletionRequest) -> int:
    """Sequences of one prompt that are submitted apart: n when the prompt is scored, else 1."""
    scored = (body.echo and body.logprobs is not None) or body.prompt_logprobs is not None
    return body.n if scored and body.n > 1 else 1


def split_prompts(body: CompletionRequest) -> list[CompletionRequest] | None:
    """One body per prompt (and per copy, prompt_copies) when `prompt` is a list of several or
    copies are made; None for one prompt (inputs.prepare takes a list of one as that prompt)."""
    prompt = body.prompt
    many = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))
    copies = prompt_copies(body)
    if not many and copies == 1:
        return None
    prompts = prompt if many else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}", param="prompt")
    if copies == 1:
        return [body.model_copy(update={"prompt": p}) for p in prompts]
    return [body.model_copy(update={"prompt": p, "n": 1, "seed": None if body.seed is None else body.seed + i})
            for p in prompts for i in range(copies)]


class PromptBatch:
    def __init__(self, requests: list[ApiRequest], copies: int = 1):
        self.requests = requests
        self.copies = copies  # consecutive requests that are one prompt's sequences (prompt_copies)
        self.request_id = requests[0].request_id
        for p, request in enumerate(requests):
            request.request_id = f"{self.request_id}-{p}"  # each prompt's record and scheduler id

    def __getattr__(self, name: str):
        """What every prompt shares (kind, model, created, sampling, stream, ...): the first's."""
        return getattr(self.requests[0], name)

    @property
    def gens(self) -> list:
        return [gen for request in self.requests for gen in request.gens]

    @property
    def why(self) -> str | None:
        return self.requests[0].why

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """(choice index, output) of every sequence of every prompt until all finish."""
        offsets = [0]
        for request in self.requests:
            offsets.append(offsets[-1] + len(request.gens))
        async for item in merge([_shifted(offsets[p], r) for p, r in enumerate(self.requests)]):
            yield item

    def close(self, reason: str) -> None:
        for request in self.requests:
            request.close(reason)

    def usage(self) -> dict:
        """Every prompt's tokens once, every choice's tokens, every prompt's cached tokens."""
        parts = [request.usage() for request in self.requests]
        firsts = parts[::self.copies]
        prompt = sum(part["prompt_tokens"] for part in firsts)
        completion = sum(part["completion_tokens"] for part in parts)
        cached = sum(part["prompt_tokens_details"]["cached_tokens"] for part in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


async def _shifted(offset: int, request: ApiRequest) -> AsyncIterator[tuple[int, Output]]:
    async for index, out in request.outputs():
        yield offset + index, out
