"""Vectorised penalties. Presence/frequency (OpenAI, generated tokens): logit -= frequency * count + presence * (count > 0).
Repetition (HF/vLLM, over prompt + generated, applied first): a seen token's logit is divided by
it when positive, multiplied when negative. Rows without penalties are untouched.
"""

from __future__ import annotations

import torch

from pagedserve.shared.messages import SamplingParams


def has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _counts(rows: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[len(rows), vocab_size] how often each token id occurs in each row."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros((len(rows), vocab_size + 1), dtype=torch.float32, device=device)
    if width:
        padded = torch.tensor([r + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab_size]  # the pad column (id vocab_size) is dropped


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                    num_prompt_tokens: list[int]) -> torch.Tensor:
    """logits [N, V] float32 -> penalised logits (new tensor if any row is); token_ids[i]: prompt + generated."""
    rows = [i for i, p in enumerate(params) if has_penalty(p)]
    if not rows:
        return logits
    device, vocab_size = logits.device, logits.shape[1]
    sub = logits[rows]
    output_counts = _counts([token_ids[i][num_prompt_tokens[i]:] for i in rows], vocab_size, device)
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=device).unsqueeze(1)
    if bool((repetition != 1.0).any()):
        seen = (output_counts > 0) | (_counts([token_ids[i][:num_prompt_tokens[i]] for i in rows], vocab_size,
                                              device) > 0)
        penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalised, sub)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device).unsqueeze(1)
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=device).unsqueeze(1)
    sub = sub - frequency * output_counts - presence * (output_counts > 0).float()
    out = logits.clone()
    out[rows] = sub
    return out
