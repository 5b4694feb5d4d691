"""min_tokens in the batched sampler: a row short of it never samples its stop tokens (EOS unless
ignore_eos, its stop_token_ids), greedy and random alike; other rows and later steps are untouched."""

import torch

from pagedserve.services.gpu_worker.sampling.min_tokens import apply_min_tokens, banned_stop_tokens
from pagedserve.services.gpu_worker.sampling.sampler import plain_greedy, sample
from pagedserve.shared.messages import SamplingParams

V, EOS, PROMPT = 32, [2], [5, 6, 7]


def _forcing(rows: int, token: int) -> torch.Tensor:
    """Logits whose argmax (and nearly all the mass) is token in every row."""
    logits = torch.randn((rows, V), generator=torch.Generator().manual_seed(3))
    logits[:, token] = 50.0
    return logits


def _sample(logits, params, num_outputs):
    histories = [PROMPT + [9] * n for n in num_outputs]
    return [t.token_id for t in sample(logits, params, [f"r{i}" for i in range(len(params))], histories,
                                       [len(PROMPT)] * len(params), eos_token_ids=EOS)]


def test_banned_ids_are_eos_and_stop_ids_until_min_tokens():
    p = SamplingParams(min_tokens=3, stop_token_ids=[11, 12])
    assert banned_stop_tokens(p, 0, EOS) == [2, 11, 12] and banned_stop_tokens(p, 2, EOS) == [2, 11, 12]
    assert banned_stop_tokens(p, 3, EOS) == []
    assert banned_stop_tokens(SamplingParams(min_tokens=3, ignore_eos=True), 0, EOS) == []
    assert banned_stop_tokens(SamplingParams(), 0, EOS) == []


def test_only_short_rows_are_masked_and_nothing_is_copied_without_them():
    logits = _forcing(3, 2)
    params = [SamplingParams(min_tokens=2, stop_token_ids=[4]), SamplingParams(min_tokens=2), SamplingParams()]
    out = apply_min_tokens(logits, params, [1, 2, 0], EOS)
    expected = logits.clone()
    expected[0, 2] = expected[0, 4] = float("-inf")
    assert torch.equal(out, expected)
    assert apply_min_tokens(logits, params[1:], [2, 0], EOS) is logits


def test_greedy_and_random_rows_short_of_min_tokens_skip_eos_then_may_end():
    logits = _forcing(4, EOS[0])
    params = [SamplingParams(min_tokens=2), SamplingParams(temperature=1.0, seed=1, min_tokens=2),
              SamplingParams(temperature=1.0, min_tokens=2), SamplingParams()]
    tokens = _sample(logits, params, [0, 1, 1, 0])
    assert EOS[0] not in tokens[:3] and tokens[3] == EOS[0]
    assert tokens[0] == int(logits[0].topk(2).indices[1])
    assert _sample(logits, params, [2, 2, 2, 0]) == [EOS[0]] * 4


def test_a_stop_token_id_is_held_back_as_eos_is():
    logits = _forcing(1, 13)
    params = [SamplingParams(min_tokens=1, stop_token_ids=[13], temperature=1.0, seed=4)]
    assert _sample(logits, params, [0]) != [13] and _sample(logits, params, [1]) == [13]


def test_plain_greedy_only_once_every_row_reached_min_tokens():
    params = [SamplingParams(min_tokens=3), SamplingParams()]
    assert not plain_greedy(params, [2, 0]) and plain_greedy(params, [3, 0]) and plain_greedy(params)
