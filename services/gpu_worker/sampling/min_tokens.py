"""vLLM's min_tokens: until a row has generated that many tokens its stop tokens (the model's EOS
unless ignore_eos, and the request's stop_token_ids) are at -inf, so it cannot end early; stop
strings wait as long at the api (detokenizer.py)."""

from __future__ import annotations

import math

import torch

from pagedserve.shared.messages import SamplingParams


def banned_stop_tokens(p: SamplingParams, num_output_tokens: int, eos_token_ids) -> list[int]:
    if num_output_tokens >= p.min_tokens:
        return []
    return ([] if p.ignore_eos else list(eos_token_ids)) + list(p.stop_token_ids)


def holds_stop_tokens(params: list[SamplingParams], num_output_tokens: list[int]) -> bool:
    return any(n < p.min_tokens for p, n in zip(params, num_output_tokens, strict=True))


def apply_min_tokens(logits: torch.Tensor, params: list[SamplingParams], num_output_tokens: list[int],
                     eos_token_ids) -> torch.Tensor:
    """logits [N, V] float32 -> the same with each row's banned ids at -inf (a new tensor if any)."""
    rows, cols = [], []
    for i, (p, n) in enumerate(zip(params, num_output_tokens, strict=True)):
        banned = banned_stop_tokens(p, n, eos_token_ids)
        rows += [i] * len(banned)
        cols += banned
    if not rows:
        return logits
    out = logits.clone()
    out[torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)] = -math.inf
    return out
