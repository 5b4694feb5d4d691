"""What the scheduler tells its neighbours about one request; every list handed out is a copy."""

from __future__ import annotations

from pagedserve.services.scheduler.request import Request
from pagedserve.shared.messages import CachedRequestData, NewRequestData, RequestDelta, SampledToken


def new_request_data(request: Request, block_ids: list[int], num_scheduled_tokens: int,
                     tier_loads: list[tuple[int, bytes]] = ()) -> NewRequestData:
    return NewRequestData(
        request.request_id,
        request.all_token_ids,
        list(block_ids),
        request.num_computed_tokens,
        num_scheduled_tokens,
        request.sampling,
        request.num_output_tokens,
        list(tier_loads),
    )


def cached_request_data(request: Request, new_block_ids: list[int], num_scheduled_tokens: int,
                        draft_token_ids: list[int] = (), num_steps: int = 1) -> CachedRequestData:
    return CachedRequestData(request.request_id, list(new_block_ids), request.num_computed_tokens, num_scheduled_tokens,
                             list(draft_token_ids), num_steps)


def request_delta(request: Request, new_token_ids: list[int], logprobs: list[SampledToken] = ()) -> RequestDelta:
    return RequestDelta(
        request.request_id,
        list(new_token_ids),
        finish_reason=request.finish_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        logprobs=list(logprobs),
    )



def stream_delta(request: Request, stream_interval: int, force: bool = False) -> RequestDelta | None:
    """Unsent output tokens if due: the first at once, then every stream_interval (force: now)."""
    if not (force or request.num_streamed_tokens == 0
            or request.num_output_tokens - request.num_streamed_tokens >= stream_interval):
        return None
    new_token_ids = request.output_token_ids[request.num_streamed_tokens:]
    request.num_streamed_tokens = request.num_output_tokens
    logprobs, request.unstreamed_logprobs = request.unstreamed_logprobs, []
    return request_delta(request, new_token_ids, logprobs)
