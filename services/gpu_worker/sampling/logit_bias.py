"""OpenAI's logit_bias: per row, a bias added to the logits of the token ids it names, after
penalties and before temperature and filters (so greedy rows see it too); rows without one
are untouched."""

from __future__ import annotations

import torch

from pagedserve.shared.messages import SamplingParams


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [N, V] float32 -> biased logits (a new tensor if any row has a bias)."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if not rows:
        return logits
    device = logits.device
    out = logits.clone()
    out.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                   torch.tensor(values, dtype=out.dtype, device=device), accumulate=True)
    return out
