"""logit_bias in the batched sampler: exact arithmetic on the rows that ask, none on the others,
greedy and random rows alike, and logprobs reported before it (raw, as vLLM)."""

import torch

from pagedserve.services.gpu_worker.sampling.logit_bias import apply_logit_bias
from pagedserve.services.gpu_worker.sampling.sampler import plain_greedy, sample
from pagedserve.shared.messages import SamplingParams

V = 32


def _logits(rows: int) -> torch.Tensor:
    return torch.randn((rows, V), generator=torch.Generator().manual_seed(7))


def _sample(logits, params):
    ids = [f"r{i}" for i in range(len(params))]
    return sample(logits, params, ids, [[1, 2]] * len(params), [2] * len(params))


def test_the_bias_adds_to_the_named_ids_of_its_row_only():
    logits = _logits(3)
    params = [SamplingParams(logit_bias={3: 5.0, 9: -100.0}), SamplingParams(), SamplingParams(logit_bias={0: 1.5})]
    out = apply_logit_bias(logits, params)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 9] -= 100.0
    expected[2, 0] += 1.5
    assert torch.equal(out, expected)
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits  # nothing asked: no copy


def test_a_plus_100_bias_forces_the_token_greedy_and_random_in_one_batch():
    logits = _logits(4)
    params = [SamplingParams(logit_bias={17: 100.0}), SamplingParams(),
              SamplingParams(temperature=1.0, seed=3, logit_bias={17: 100.0}), SamplingParams(temperature=0.0)]
    assert not plain_greedy(params[:1]) and plain_greedy(params[1:2])
    tokens = [t.token_id for t in _sample(logits, params)]
    assert tokens[0] == 17 and tokens[2] == 17
    assert tokens[1] == int(logits[1].argmax()) and tokens[3] == int(logits[3].argmax())


def test_a_minus_100_bias_bans_the_argmax_and_logprobs_stay_raw():
    logits = _logits(1)
    top = int(logits[0].argmax())
    [token] = _sample(logits, [SamplingParams(logit_bias={top: -100.0}, logprobs=0)])
    assert token.token_id != top and token.token_id == int(logits[0].topk(2).indices[1])
    assert abs(token.logprob - float(logits[0].log_softmax(0)[token.token_id])) < 1e-6
