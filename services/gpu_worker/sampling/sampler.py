"""Batched sampling, one call per step: penalties, then argmax or filters plus an exponential race
on counter-based noise, so a seeded row's output does not depend on the batch."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.sampling.logit_bias import apply_logit_bias
from pagedserve.services.gpu_worker.sampling.noise import exponential_noise, random_keys, seeded_key
from pagedserve.services.gpu_worker.sampling.penalties import apply_penalties, has_penalty
from pagedserve.shared.messages import SampledToken, SamplingParams


def _apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V] float32 of random rows -> filtered, temperature-scaled logits."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        k = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k], device=device)
        sorted_desc = logits.sort(dim=1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1).clamp(max=logits.shape[1] - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        probs_sorted, idx = logits.softmax(1).sort(dim=1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs_sorted.cumsum(1) - probs_sorted
        drop_sorted = mass_before >= torch.tensor(top_p, device=device).unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    min_p = [p.min_p for p in params]
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(1)
        floor = probs.max(1, keepdim=True).values * torch.tensor(min_p, device=device).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _noise_keys(params: list[SamplingParams], positions: list[int]) -> list[int]:
    keys = random_keys(len(params))  # unseeded rows keep these
    for i, p in enumerate(params):
        if p.seed is not None:
            keys[i] = seeded_key(p.seed, positions[i])
    return keys


def plain_greedy(params: list[SamplingParams]) -> bool:
    return all(p.temperature <= 0.0 and p.logprobs is None and not has_penalty(p) and not p.logit_bias
               for p in params)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Row argmax of logits [N, V] (first on ties); CPU bf16 or float32 is read in place by the fused kernel."""
    on_cpu = logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and logits.dim() == 2
    fused = cpu_extensions.load("fused") if on_cpu else None
    if fused is not None:
        return fused.argmax_rows(logits).tolist()
    return logits.max(dim=1).indices.tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
           token_ids: list[list[int]], num_prompt_tokens: list[int]) -> list[SampledToken]:
    """logits [N, V] float32 -> a SampledToken per row; logprobs are before penalties, logit_bias and temperature."""
    processed = apply_logit_bias(apply_penalties(logits, params, token_ids, num_prompt_tokens), params)
    greedy = torch.tensor([p.temperature <= 0.0 for p in params], device=logits.device)
    # max(dim).indices is argmax (first index of the maximum), cheaper on the CPU
    token_ids_out = processed.max(dim=1).indices
    random_rows = (~greedy).nonzero().flatten().tolist()
    if random_rows:
        sub_params = [params[i] for i in random_rows]
        probs = _apply_filters(processed[random_rows], sub_params).softmax(1)
        keys = _noise_keys(sub_params, [len(token_ids[i]) for i in random_rows])
        noise = exponential_noise(keys, probs.shape[1], logits.device)
        token_ids_out[random_rows] = (probs / noise).argmax(dim=1)
    token_list = token_ids_out.tolist()
    want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    out = [SampledToken(request_id=r, token_id=t) for r, t in zip(request_ids, token_list, strict=True)]
    if want_logprobs:
        logprobs = logits[want_logprobs].log_softmax(dim=1)
        for row, i in enumerate(want_logprobs):
            out[i].logprob = float(logprobs[row, token_list[i]])
            k = params[i].logprobs or 0
            if k > 0:
                values, ids = logprobs[row].topk(k)
                out[i].top_logprobs = list(zip(ids.tolist(), values.tolist(), strict=True))
    return out
