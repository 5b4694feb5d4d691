"""Parallel sampling (OpenAI `n` > 1): the names and sampling params of the n sequences.

One SubmitRequest carries n; the scheduler prefills the prompt once (all but its last
token) and then forks the blocks into n children, which share them and copy the partial
last block on write. Every service derives the children the same way from here:
- child i of request R is named f"{R}.{i}" (n == 1: R itself, nothing is forked);
- child i samples with n=1 and seed + i (no seed: none), as vLLM does, so each child's
  output equals what a request with that seed alone gives.
"""

from __future__ import annotations

from dataclasses import replace

from shared.messages import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    if n <= 1:
        return [request_id]
    return [f"{request_id}.{index}" for index in range(n)]


def child_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    seed = None if sampling.seed is None else sampling.seed + index
    return replace(sampling, n=1, seed=seed, stop_token_ids=list(sampling.stop_token_ids))
