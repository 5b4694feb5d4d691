"""Draft verification on the worker (sampling/verify.py): the agreeing prefix on exact rows, each
row's history, a seeded row sampled as a lone step samples it, and the distribution kept: on a
4-token vocabulary the emitted tokens follow the model's distribution (chi-square) whatever the drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from scipy.stats import chisquare

from pagedserve.services.gpu_worker.sampling.sampler import sample
from pagedserve.services.gpu_worker.sampling.verify import accept_drafts, draft_histories
from pagedserve.shared.messages import SampledToken, SamplingParams


@dataclass
class State:
    token_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)


def rows(request_id: str, tokens: list[int]) -> list[SampledToken]:
    return [SampledToken(request_id, t) for t in tokens]


def test_drafts_are_accepted_up_to_the_first_disagreement():
    sampled, accepted = accept_drafts(rows("a", [5, 6, 9, 1]) + rows("b", [3]) + rows("c", [2, 8]),
                                      [[5, 6, 7]] * 4 + [[]] + [[4]] * 2)
    assert [(t.request_id, t.token_id) for t in accepted] == [("a", 5), ("a", 6)]
    assert [(t.request_id, t.token_id) for t in sampled] == [("a", 9), ("b", 3), ("c", 2)]


def test_all_drafts_accepted_then_the_bonus_token():
    sampled, accepted = accept_drafts(rows("a", [5, 6, 7]), [[5, 6]] * 3)
    assert [t.token_id for t in accepted] == [5, 6] and [t.token_id for t in sampled] == [7]


def test_each_row_sees_the_drafts_ahead_of_it():
    a, b = State([1, 2], [7, 8]), State([3])
    assert draft_histories(["a", "a", "a", "b"], [a, a, a, b]) == [[1, 2], [1, 2, 7], [1, 2, 7, 8], [3]]


def test_a_seeded_row_samples_as_a_lone_step_at_its_position():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=42)
    state = State([1, 2, 3], [11, 12])
    together = sample(logits, [params] * 3, ["a"] * 3, draft_histories(["a"] * 3, [state] * 3), [2] * 3)
    alone = [sample(logits[j:j + 1], [params], ["a"], [[1, 2, 3] + [11, 12][:j]], [2])[0] for j in range(3)]
    assert [t.token_id for t in together] == [t.token_id for t in alone]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emitted_tokens_keep_the_models_distribution(temperature):
    """Per request: drafts (d1, d2); row 0 has distribution p0, row 1 (after d1) p1. The first emitted
    token must follow p0 whatever d1 is, and after an accepted d1 the next must follow p1."""
    torch.manual_seed(1234)
    num, vocab = 20000, 4
    row_logits = torch.tensor([[1.0, 0.2, -0.5, 0.6], [0.1, 1.2, 0.3, -1.0], [0.0, 0.0, 0.0, 0.0]])
    probs = (row_logits.double() / temperature).softmax(dim=1)
    drafts = [0, 1]  # d1 is p0's likeliest token, d2 p1's
    params = [SamplingParams(temperature=temperature)] * (3 * num)
    ids = [f"r{i}" for i in range(num) for _ in range(3)]
    state = State([2, 3], drafts)
    out = sample(row_logits.repeat(num, 1), params, ids, draft_histories(ids, [state] * len(ids)), [2] * len(ids))
    sampled, accepted = accept_drafts(out, [drafts] * len(ids))
    emitted: dict[str, list[int]] = {}
    for token in accepted:
        emitted.setdefault(token.request_id, []).append(token.token_id)
    for token in sampled:
        emitted.setdefault(token.request_id, []).append(token.token_id)
    first = torch.bincount(torch.tensor([e[0] for e in emitted.values()]), minlength=vocab).double()
    assert chisquare(first, probs[0] * num).pvalue > 1e-3
    second = [e[1] for e in emitted.values() if e[0] == drafts[0]]
    counts = torch.bincount(torch.tensor(second), minlength=vocab).double()
    assert chisquare(counts, probs[1] * len(second)).pvalue > 1e-3
    # the acceptance rate of d1 is p0(d1), as rejection sampling with a one-token draft gives
    assert abs(len(second) / num - float(probs[0, 0])) < 0.02
