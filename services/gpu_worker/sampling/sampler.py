"""Batched sampling, one call per step: logit processors (penalties, logit_bias), then argmax for
greedy rows and filters plus an exponential race on counter-based noise for the others (race.py), so
a seeded row's output does not depend on the batch."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.sampling.grammar import apply_bitmask
from pagedserve.services.gpu_worker.sampling.logit_bias import apply_logit_bias
from pagedserve.services.gpu_worker.sampling.min_tokens import apply_min_tokens, holds_stop_tokens
from pagedserve.services.gpu_worker.sampling.noise import random_keys, seeded_key
from pagedserve.services.gpu_worker.sampling.penalties import apply_penalties, has_penalty
from pagedserve.services.gpu_worker.sampling.race import fused_kernel, race_tokens
from pagedserve.shared.messages import SampledToken, SamplingParams


def _noise_keys(params: list[SamplingParams], positions: list[int]) -> list[int]:
    keys = random_keys(len(params))  # unseeded rows keep these
    for i, p in enumerate(params):
        if p.seed is not None:
            keys[i] = seeded_key(p.seed, positions[i])
    return keys


def _wants_logit_processors(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            or bool(p.logit_bias) or p.min_tokens > 0)


def plain_greedy(params: list[SamplingParams], num_output_tokens: list[int] | None = None) -> bool:
    """num_output_tokens: each row's generated tokens (None: as if min_tokens were reached)."""
    if not all(p.temperature <= 0.0 and p.logprobs is None for p in params):
        return False
    if not any(_wants_logit_processors(p) for p in params):
        return True
    return not any(has_penalty(p) or p.logit_bias for p in params) and not (
        num_output_tokens and holds_stop_tokens(params, num_output_tokens))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Row argmax of logits [N, V] (first on ties); CPU bf16 or float32 is read in place by the fused kernel."""
    on_cpu = logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and logits.dim() == 2
    fused = cpu_extensions.load("fused") if on_cpu else None
    if fused is not None:
        return fused.argmax_rows(logits).tolist()
    return logits.max(dim=1).indices.tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str],
           token_ids: list[list[int]], num_prompt_tokens: list[int], masks=None,
           eos_token_ids: list[int] = ()) -> list[SampledToken]:
    """logits [N, V] float32 -> a SampledToken per row; logprobs are after the grammar's mask, before
    penalties, logit_bias, min_tokens and temperature. masks: the step's grammar masks (Grammars.start_masks),
    joined here; the kernel's race reads a random row's mask itself and visits only its allowed tokens.
    eos_token_ids: the model's, masked (with stop_token_ids) in rows short of their min_tokens."""
    bitmask, masked = masks.result() if masks is not None else (None, [])
    fused = fused_kernel(logits) is not None
    # rows whose masked logits torch reads (greedy rows, logprobs), or every masked row without the kernel
    early = [i for i in masked if not fused or params[i].temperature <= 0.0 or params[i].logprobs is not None]
    if early:
        apply_bitmask(logits, bitmask, early)
    processed = logits
    if any(_wants_logit_processors(p) for p in params):
        processed = apply_logit_bias(apply_penalties(logits, params, token_ids, num_prompt_tokens), params)
        processed = apply_min_tokens(processed, params, [len(t) - n for t, n in zip(token_ids, num_prompt_tokens,
                                                                                    strict=True)], eos_token_ids)
    # further logit processors chain here, each [N, V] float32 -> [N, V], rows it does not touch unchanged
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if len(random_rows) < len(params):
        # max(dim).indices is argmax (first index of the maximum), cheaper on the CPU
        token_ids_out = processed.max(dim=1).indices
    else:
        token_ids_out = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    if random_rows:
        sub_params = [params[i] for i in random_rows]
        keys = _noise_keys(sub_params, [len(token_ids[i]) for i in random_rows])
        rows = processed if len(random_rows) == len(params) else processed[random_rows]
        late = set(masked).difference(early)
        sub_masked = [j for j, i in enumerate(random_rows) if i in late]
        sub_bitmask = bitmask if not sub_masked or len(random_rows) == len(params) else bitmask[random_rows]
        token_ids_out[random_rows] = race_tokens(rows, sub_params, keys, sub_bitmask,
                                                 sub_masked).to(token_ids_out.device)
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
