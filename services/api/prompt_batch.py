"""A list of prompts on /v1/completions: one ApiRequest per prompt, submitted together (so they
share the scheduler's steps), answered as one response whose choice `p * n + i` is choice i of
prompt p, as OpenAI indexes them.

It stands where openai_routes and openai_format expect an ApiRequest: the first prompt's fields,
`gens` flattened in choice order, `outputs()` merged, usage summed over the prompts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.services.api.generation import Output
from pagedserve.services.api.protocol import ApiError, CompletionRequest
from pagedserve.services.api.request import ApiRequest, merge

MAX_PROMPTS = 256  # prompts in one request (each with its n choices)


def split_prompts(body: CompletionRequest) -> list[CompletionRequest] | None:
    """One body per prompt when `prompt` is a list of several; None for one prompt (inputs.prepare
    takes a list of one as that prompt)."""
    prompt = body.prompt
    if not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))):
        return None
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", param="prompt")
    return [body.model_copy(update={"prompt": p}) for p in prompt]


class PromptBatch:
    def __init__(self, requests: list[ApiRequest]):
        self.requests = requests
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
        """Every prompt's tokens, every choice's tokens, every prompt's cached tokens."""
        parts = [request.usage() for request in self.requests]
        usage = {key: sum(part[key] for part in parts) for key in ("prompt_tokens", "completion_tokens",
                                                                   "total_tokens")}
        usage["prompt_tokens_details"] = {"cached_tokens": sum(p["prompt_tokens_details"]["cached_tokens"]
                                                               for p in parts)}
        return usage


async def _shifted(offset: int, request: ApiRequest) -> AsyncIterator[tuple[int, Output]]:
    async for index, out in request.outputs():
        yield offset + index, out
