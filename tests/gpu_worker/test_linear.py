"""PackedLinear: oneDNN-packed bf16 weights give F.linear's results; float32 is never packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.model.linear import PackedLinear, packing_enabled


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300])
def test_packed_bf16_equals_f_linear(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 48, generator=gen).to(torch.bfloat16)
    x = torch.randn(num_rows, 48, generator=gen).to(torch.bfloat16)
    linear = PackedLinear(weight)
    assert (linear.packed is not None) == packing_enabled(weight)
    torch.testing.assert_close(linear(x), F.linear(x, weight), atol=0, rtol=0)


def test_float32_and_unpacked_follow_the_parameter(monkeypatch):
    weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    linear = PackedLinear(weight)
    assert linear.packed is None
    with torch.no_grad():
        weight.mul_(2)
    x = torch.randn(3, 4)
    assert torch.equal(linear(x), F.linear(x, weight))
    monkeypatch.setenv("PAGEDSERVE_PACK_WEIGHTS", "0")
    assert PackedLinear(weight.to(torch.bfloat16)).packed is None
