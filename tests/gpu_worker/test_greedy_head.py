"""The greedy head without logits (model/greedy_head.py, cpu_head_argmax.cpp's argmax_many): a
head in GGUF blocks gives exactly the argmax of linear_many's logits; a float32 weight gives the
float32 product's argmax; ties go to the first index; a row with nothing above -inf is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.greedy_head import MIN_ROWS, GreedyHead
from pagedserve.services.gpu_worker.model.linear import PackedLinear


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _greedy(head: PackedLinear) -> GreedyHead:
    greedy = GreedyHead.build(head)
    if greedy is None:
        pytest.skip("no AVX2/FMA/F16C build of the CPU kernels here")
    return greedy


def _q8_head(vocab: int, hidden: int, seed: int) -> PackedLinear:
    q = torch.randint(-127, 128, (vocab, hidden), dtype=torch.int8, generator=_gen(seed))
    d = (torch.rand(vocab, hidden // 32, generator=_gen(seed + 1)) * 0.01).half()
    weight = gguf_blocks.dequantize(q, d).float()
    return PackedLinear(weight, blocks=(q, d))


@pytest.mark.parametrize(("rows", "hidden"), [(5, 64), (23, 64), (64, 288), (130, 96)])
def test_blocks_give_the_argmax_of_linear_manys_logits_bit_for_bit(rows, hidden):
    head = _q8_head(2048, hidden, seed=rows)
    greedy = _greedy(head)
    assert head.gemv_q8 is not None
    x = torch.randn(rows, hidden, generator=_gen(7))
    if rows <= head.max_gemv_rows:  # the few-row kernels' rows are not its own
        assert greedy.tokens(x) is None
        return
    fused = cpu_extensions.load("fused")
    assert greedy.tokens(x) == fused.argmax_rows(head(x)).tolist()


@pytest.mark.parametrize("rows", [MIN_ROWS, 37, 256])
def test_a_float32_weight_gives_the_float32_products_argmax(rows):
    weight = torch.randn(4096, 128, generator=_gen(rows)) * 0.05
    x = torch.randn(rows, 128, generator=_gen(rows + 1))
    tokens = _greedy(PackedLinear(weight)).tokens(x)
    expected = (x.double() @ weight.double().T).argmax(dim=1)
    logits = F.linear(x, weight)
    top2 = logits.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # rows whose leader float32's rounding cannot change
    assert clear.sum() > rows // 2
    assert torch.equal(torch.tensor(tokens)[clear], expected[clear])


def test_exact_ties_go_to_the_first_index_across_blocks_and_threads():
    weight = torch.randn(4096, 64, generator=_gen(3)) * 0.01
    x = torch.randn(MIN_ROWS, 64, generator=_gen(4))
    direction = x[0] / x[0].norm()
    for v in (3001, 17, 2050, 18):  # lanes and blocks apart; 17 first
        weight[v] = direction
    x[1] = x[0]
    assert _greedy(PackedLinear(weight)).tokens(x)[:2] == [17, 17]


def test_fewer_rows_and_a_row_of_nan_are_left_to_the_plain_head():
    greedy = _greedy(PackedLinear(torch.randn(1024, 64)))
    assert greedy.tokens(torch.randn(MIN_ROWS - 1, 64)) is None
    x = torch.randn(MIN_ROWS, 64)
    x[3] = float("nan")
    assert greedy.tokens(x) is None


def test_only_float32_cpu_heads_with_whole_blocks_are_taken(monkeypatch):
    assert GreedyHead.build(PackedLinear(torch.randn(1024, 64).to(torch.bfloat16))) is None
    assert GreedyHead.build(PackedLinear(torch.randn(1000, 64))) is None  # vocab not a multiple of 16
    monkeypatch.setenv("PAGEDSERVE_GREEDY_HEAD", "0")
    assert GreedyHead.build(PackedLinear(torch.randn(1024, 64))) is None
