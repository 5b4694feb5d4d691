"""The bf16-screened float32 LM head (model/screened_head.py, kernels/cpu_head_argmax.cpp): its
greedy tokens are the float32 head's, ties to the first index, on CPUs that compute bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.model.screened_head import MIN_ROWS, ScreenedHead


def _head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


def _screen(weight: torch.Tensor) -> ScreenedHead:
    screen = ScreenedHead.build(weight)
    if screen is None:
        pytest.skip("no native bf16 on this CPU (or kernels off): the plain head serves")
    return screen


@pytest.mark.parametrize("scale", [0.1, 3.0, 300.0])
def test_tokens_are_the_float32_heads_argmax(scale):
    weight = _head(8192, 64, seed=1)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)) * scale
    tokens, counts = _screen(weight).tokens_and_counts(hidden)
    assert tokens == F.linear(hidden, weight).max(dim=1).indices.tolist()
    assert counts.min() >= 1 and counts.float().mean() < 64  # the screen leaves few to recompute


def test_near_ties_are_recomputed_and_exact_ties_go_to_the_first_index():
    weight = _head(4096, 64, seed=3)
    hidden = torch.randn(MIN_ROWS, 64, generator=torch.Generator().manual_seed(4))
    direction = hidden[0] / hidden[0].norm()
    weight[900] = weight[30] = direction  # row 0: an exact tie, 30 first
    weight[2000] = direction * (1 + 2**-12)  # row 1's leader by less than a bf16 step
    weight[1000] = direction
    hidden[1] = hidden[0]
    hidden[1] *= 2
    tokens = _screen(weight).tokens(hidden)
    assert tokens[0] == 2000 and tokens[1] == 2000
    weight[2000] = 0.0
    assert _screen(weight).tokens(hidden)[:2] == [30, 30]


def test_a_row_without_a_finite_bound_is_left_to_the_plain_head():
    hidden = torch.randn(MIN_ROWS, 64)
    hidden[3, 5] = float("inf")
    assert _screen(_head(1024, 64, seed=5)).tokens(hidden) is None


def test_only_float32_cpu_heads_are_screened(monkeypatch):
    assert ScreenedHead.build(_head(1024, 64, seed=6).to(torch.bfloat16)) is None
    monkeypatch.setenv("PAGEDSERVE_SCREENED_HEAD", "0")
    assert ScreenedHead.build(_head(1024, 64, seed=6)) is None


@pytest.mark.slow
def test_smollm2_float32_batch_greedy_is_the_plain_heads(monkeypatch):
    from pagedserve.services.engine import Engine
    from pagedserve.shared.config import EngineConfig
    from pagedserve.shared.messages import SamplingParams

    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 3046, 28] + [100 + 37 * i + j for j in range(i % 7 + 1)]
               for i in range(2 * MIN_ROWS)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        engine = Engine(EngineConfig(dtype="float32", num_blocks=256))
        return [o.token_ids for o in engine.generate(prompts, params)]

    screened = run()
    monkeypatch.setenv("PAGEDSERVE_SCREENED_HEAD", "0")
    assert screened == run()


def test_a_head_bf16_cannot_rank_turns_the_screen_off_after_answering():
    weight = _head(2048, 64, seed=7)
    weight[:] = weight[0] * (1 + torch.arange(2048).unsqueeze(1) * 2**-20)  # logits within a bf16 step
    hidden = torch.randn(MIN_ROWS, 64, generator=torch.Generator().manual_seed(8)).abs()
    screen = _screen(weight)
    assert screen.tokens(hidden) == F.linear(hidden, weight).max(dim=1).indices.tolist()
    assert not screen.enabled and screen.tokens(hidden) is None
