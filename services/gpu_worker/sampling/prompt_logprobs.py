"""Logprobs of a prompt's own tokens (OpenAI's echo, vLLM's prompt_logprobs): the rows of a
prefill chunk predict the prompt's next tokens, raw log_softmax in float32 like the sampler's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.shared.messages import PromptLogprobs, SampledToken


@dataclass
class PromptSpan:
    """Rows row .. row + count - 1 of a step's hidden states predict prompt tokens first .. first + count - 1."""

    request_id: str
    row: int
    first: int
    count: int
    targets: list[int]  # the prompt tokens they predict
    num_top: int


def prompt_span(request_id: str, row: int, start: int, num_scheduled: int, token_ids: list[int],
                num_prompt_tokens: int, num_top: int | None) -> PromptSpan | None:
    """The span of a chunk computing positions start .. start + num_scheduled - 1, if it predicts any
    prompt token (position p predicts token p + 1) and its request asked."""
    end = min(start + num_scheduled, num_prompt_tokens - 1)
    if num_top is None or end <= start:
        return None
    return PromptSpan(request_id, row, start + 1, end - start, token_ids[start + 1:end + 1], num_top)


def prompt_logprobs(compute_logits, hidden: torch.Tensor, spans: list[PromptSpan]) -> list[PromptLogprobs]:
    """hidden [rows, H] of one step -> each span's logprobs; compute_logits: hidden -> float32 logits."""
    out = []
    for span in spans:
        logprobs = compute_logits(hidden[span.row:span.row + span.count]).float().log_softmax(dim=1)
        targets = torch.tensor(span.targets, device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))
        ranks = (logprobs >= chosen).sum(dim=1).tolist()  # as vLLM: tokens at least as likely, itself included
        chosen = chosen.squeeze(1).tolist()
        tops = logprobs.topk(span.num_top, dim=1) if span.num_top > 0 else None
        tokens = []
        for i, (token_id, logprob) in enumerate(zip(span.targets, chosen, strict=True)):
            top = list(zip(tops.indices[i].tolist(), tops.values[i].tolist(), strict=True)) if tops else None
            tokens.append(SampledToken(span.request_id, token_id, logprob, top))
        out.append(PromptLogprobs(span.request_id, span.first, tokens, ranks))
    return out
