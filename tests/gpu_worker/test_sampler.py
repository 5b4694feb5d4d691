"""The batched sampler on hand-made logits: seeded rows independent of the batch, the
noise's distribution, the filters, the penalties' exact arithmetic, raw logprobs."""

import math

import torch

from pagedserve.services.gpu_worker.sampling.noise import exponential_noise, seeded_key
from pagedserve.services.gpu_worker.sampling.penalties import apply_penalties
from pagedserve.services.gpu_worker.sampling.sampler import sample
from pagedserve.shared.messages import SamplingParams

V = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, V), generator=torch.Generator().manual_seed(seed)) * 2


def _sample(logits, params, histories=None):
    histories = histories or [[1, 2, 3]] * len(params)
    return [t.token_id for t in sample(logits, params, [f"r{i}" for i in range(len(params))], histories,
                                       [3] * len(params))]


def test_a_seeded_row_samples_the_same_alone_and_anywhere_in_any_batch():
    target = _logits(1, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _sample(target, [seeded])
    for others in (1, 5):
        other_logits = _logits(others, seed=2)
        other_params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0)] * others
        batch = torch.cat([other_logits, target, other_logits])
        params = other_params[:others] + [seeded] + other_params[:others]
        assert _sample(batch, params, [[1, 2, 3]] * len(params))[others] == alone[0]


def test_a_seeded_row_depends_on_its_position_and_seed_only():
    logits = _logits(1, seed=3)
    p = SamplingParams(temperature=1.0, seed=5)
    draws = [_sample(logits, [p], [[0] * n])[0] for n in range(3, 40)]
    assert len(set(draws)) > 5  # a new position draws new noise
    assert draws == [_sample(logits, [p], [[9] * n])[0] for n in range(3, 40)]  # not the history's values
    assert [_sample(logits, [SamplingParams(temperature=1.0, seed=6)], [[0] * n])[0] for n in range(3, 40)] != draws


def test_the_noise_is_exponential_and_uncorrelated_between_neighbouring_keys():
    noise = exponential_noise([seeded_key(s, 0) for s in range(64)], 4096, "cpu")
    assert noise.min() > 0 and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01
    assert abs(noise.var().item() - 1.0) < 0.03
    correlation = torch.corrcoef(noise[:2])[0, 1].item()
    assert abs(correlation) < 0.05


def test_sampled_frequencies_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((1, V), -math.inf)
    logits[0, :4] = probs.log()
    counts = torch.zeros(4)
    for position in range(4000):
        counts[_sample(logits, [SamplingParams(temperature=1.0, seed=11)], [[0] * position])[0]] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.025)


def test_filters_never_let_a_cut_token_through():
    logits = torch.arange(V, dtype=torch.float32).unsqueeze(0) / 8  # token V-1 most likely
    for position in range(200):
        history = [[0] * position]
        assert _sample(logits, [SamplingParams(temperature=2.0, top_k=3, seed=1)], history)[0] >= V - 3
        top_p = _sample(logits, [SamplingParams(temperature=1.0, top_p=0.3, seed=1)], history)[0]
        assert top_p >= V - 4  # the top four hold over 30% of the mass (1 - e^-1/8 per step down)
        min_p = _sample(logits, [SamplingParams(temperature=1.0, min_p=0.5, seed=1)], history)[0]
        assert min_p >= V - 6  # p >= max/2: within 8 * ln 2 = 5.5 logits of the top


def test_penalties_exact_arithmetic():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    # prompt [0, 1], output [2, 2, 3]
    history, num_prompt = [[0, 1, 2, 2, 3]], [2]
    freq = apply_penalties(logits, [SamplingParams(frequency_penalty=0.5)], history, num_prompt)
    assert freq.tolist() == [[2.0, -2.0, 0.0, 0.0, 3.0]]
    presence = apply_penalties(logits, [SamplingParams(presence_penalty=0.25)], history, num_prompt)
    assert presence.tolist() == [[2.0, -2.0, 0.75, 0.25, 3.0]]
    repetition = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], history, num_prompt)
    assert repetition.tolist() == [[1.0, -4.0, 0.5, 0.25, 3.0]]  # prompt tokens count too
    assert apply_penalties(logits, [SamplingParams()], history, num_prompt) is logits


def test_penalties_apply_per_row_and_to_greedy_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0], [3.0, 2.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=0.0)]
    tokens = sample(logits, params, ["a", "b"], [[5, 0], [5, 0]], [1, 1])
    assert [t.token_id for t in tokens] == [1, 0]


def test_logprobs_are_the_models_before_penalties_and_temperature():
    logits = _logits(1, seed=4)
    params = SamplingParams(temperature=0.5, seed=3, logprobs=3, frequency_penalty=2.0)
    (token,) = sample(logits, [params], ["r"], [[1, 2]], [1])
    raw = logits.log_softmax(1)[0]
    assert math.isclose(token.logprob, raw[token.token_id].item(), rel_tol=1e-6)
    assert [t for t, _ in token.top_logprobs] == raw.topk(3).indices.tolist()


def test_greedy_tokens_reads_bf16_or_float_logits_alike():
    from pagedserve.services.gpu_worker.sampling.sampler import greedy_tokens, plain_greedy

    logits = torch.randn(9, 500, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert greedy_tokens(logits) == greedy_tokens(logits.float()) == logits.float().argmax(dim=1).tolist()
    assert plain_greedy([SamplingParams(), SamplingParams(max_tokens=3)])
    assert not plain_greedy([SamplingParams(), SamplingParams(temperature=0.7)])
    assert not plain_greedy([SamplingParams(logprobs=0)])
    assert not plain_greedy([SamplingParams(presence_penalty=0.5)])
