"""PackedLinear: oneDNN-packed bf16 weights give F.linear's results, float32 ones within rounding;
unpacked projections follow their parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.model.bf16_gemm import float32_from_rows
from pagedserve.services.gpu_worker.model.linear import PackedLinear, packing_enabled


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_bf16_equals_f_linear(num_rows, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_BF16_F32_ROWS", "0")  # oneDNN's bf16 product throughout
    float32_from_rows.cache_clear()
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 48, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_rows, 48, generator=gen).to(torch.bfloat16)
    linear = PackedLinear(weight)
    assert (linear.packed is not None) == packing_enabled(weight)
    torch.testing.assert_close(linear(x), F.linear(x, weight), atol=0, rtol=0)


@pytest.mark.parametrize("num_rows", [1, 9, 64, 300])
def test_packed_float32_matches_f_linear(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 576, generator=gen)
    x = torch.randn(num_rows, 576, generator=gen)
    linear = PackedLinear(weight)
    assert (linear.packed is not None) == packing_enabled(weight)
    # float32 sums over 576 terms in another order: a few ulps of the terms' magnitude
    bound = 576 * 2.0 ** -23 * (x.abs() @ weight.abs().T)
    assert ((linear(x) - F.linear(x, weight)).abs() <= bound).all()


def test_unpacked_follows_the_parameter(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PACK_WEIGHTS", "0")
    weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    linear = PackedLinear(weight)
    assert linear.packed is None
    with torch.no_grad():
        weight.mul_(2)
    x = torch.randn(3, 4)
    assert torch.equal(linear(x), F.linear(x, weight))
    assert PackedLinear(weight.to(torch.bfloat16)).packed is None
