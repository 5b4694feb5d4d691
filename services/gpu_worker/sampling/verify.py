"""Verifying drafts (speculative decoding): a request with d drafts has d + 1 sampling rows, row j
predicting the token after its known tokens and drafts[:j]. Every row is sampled as a lone step would
sample it (greedy: argmax; random: the race, seeded by the row's position), and the drafts are
accepted up to the first that differs from its row's token; that row's token follows them.

For random rows this is rejection sampling with a one-token draft distribution q = 1[d]: the race
picks d with probability p(d) = min(1, p(d) / q(d)), and otherwise a token drawn from p without d,
which is the normalized residual max(0, p - q). So the output distribution is the model's, and a
seeded request's tokens are the same with speculation or without.
"""

from __future__ import annotations

from pagedserve.shared.messages import SampledToken


def draft_histories(row_request_ids: list[str], states) -> list[list[int]]:
    """The tokens before each row: its request's known tokens and the drafts ahead of the row
    (penalties count them; a seeded row's noise key is its position, the history's length)."""
    histories: list[list[int]] = []
    for i, (request_id, state) in enumerate(zip(row_request_ids, states, strict=True)):
        j = 0
        while i - j - 1 >= 0 and row_request_ids[i - j - 1] == request_id:
            j += 1
        histories.append(state.token_ids + state.draft_token_ids[:j] if j else state.token_ids)
    return histories


def accept_drafts(rows: list[SampledToken], row_drafts: list[list[int]]) -> tuple[list[SampledToken],
                                                                                  list[SampledToken]]:
    """rows: the sampled token of every row, a request's d + 1 rows together; row_drafts: each row's
    request's drafts. -> (one token per request, the accepted drafts in order)."""
    sampled: list[SampledToken] = []
    accepted: list[SampledToken] = []
    i = 0
    while i < len(rows):
        drafts = row_drafts[i]
        j = 0
        while j < len(drafts) and rows[i + j].token_id == drafts[j]:
            j += 1
        accepted.extend(rows[i:i + j])
        sampled.append(rows[i + j])
        i += len(drafts) + 1
    return sampled, accepted
