"""Parallel sampling (OpenAI `n` > 1): the names and sampling params of the n sequences.

Every service derives the children from here: child i of R is f"{R}.{i}" (n == 1: R itself)
and samples with n=1 and seed + i (no seed: none), so it equals a lone request with that seed.
"""

from __future__ import annotations

from dataclasses import replace

from pagedserve.shared.messages import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    if n <= 1:
        return [request_id]
    return [f"{request_id}.{index}" for index in range(n)]


def child_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    seed = None if sampling.seed is None else sampling.seed + index
    return replace(sampling, n=1, seed=seed, stop_token_ids=list(sampling.stop_token_ids))
