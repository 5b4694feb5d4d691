"""bf16 products of many rows as float32 (model/bf16_gemm.py): the same products summed in float32 and
rounded once, taken from the measured number of rows on, never below it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.model import bf16_gemm
from pagedserve.services.gpu_worker.model.linear import PackedLinear, packing_enabled
from pagedserve.shared.config_error import ConfigError


@pytest.fixture
def from_rows(monkeypatch):
    def force(rows: int) -> None:
        monkeypatch.setenv("PAGEDSERVE_BF16_F32_ROWS", str(rows))
        bf16_gemm.float32_from_rows.cache_clear()

    yield force
    bf16_gemm.float32_from_rows.cache_clear()


def _operands(num_rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    return weight, torch.randn(num_rows, 64, generator=gen).to(torch.bfloat16)


def test_via_float32_is_the_float32_product_rounded_once():
    weight, x = _operands(5)
    expected = (x.double() @ weight.double().T)  # bf16 x bf16 products are exact; float32 sums them
    out = bf16_gemm.via_float32(x, weight)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 96)
    torch.testing.assert_close(out.float(), expected.float(), atol=0.02, rtol=0.01)
    assert torch.equal(out, F.linear(x.float(), weight.float()).to(torch.bfloat16))


@pytest.mark.parametrize("num_rows, wide", [(1, False), (8, False), (9, True), (300, True)])
def test_packed_bf16_rows_from_the_threshold_run_as_float32(from_rows, num_rows, wide):
    from_rows(9)
    weight, x = _operands(num_rows, num_rows)
    linear = PackedLinear(weight)
    if not packing_enabled(weight):
        pytest.skip("oneDNN packs no bf16 on this CPU: F.linear throughout")
    assert linear.float32_from_rows == 9
    out = linear(x)
    if wide:
        assert torch.equal(out, bf16_gemm.via_float32(x, weight))
    else:
        torch.testing.assert_close(out, F.linear(x, weight), atol=0, rtol=0)


def test_zero_turns_it_off_and_float32_weights_never_take_it(from_rows):
    from_rows(0)
    weight, x = _operands(300)
    assert PackedLinear(weight).float32_from_rows == 0
    from_rows(9)
    assert PackedLinear(weight.float()).float32_from_rows == 0


def test_off_unless_asked_and_auto_measures(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_BF16_F32_ROWS", raising=False)
    bf16_gemm.float32_from_rows.cache_clear()
    assert bf16_gemm.float32_from_rows() == 0
    monkeypatch.setenv("PAGEDSERVE_BF16_F32_ROWS", "auto")
    bf16_gemm.float32_from_rows.cache_clear()
    rows = bf16_gemm.float32_from_rows()
    bf16_gemm.float32_from_rows.cache_clear()
    assert rows == 0 or rows >= bf16_gemm.MIN_ROWS


@pytest.mark.parametrize("text", ["many", "-1", "1.5", ""])
def test_a_bad_forced_row_count_names_the_variable(from_rows, text):
    from_rows(0)
    os.environ["PAGEDSERVE_BF16_F32_ROWS"] = text  # the fixture's monkeypatch restores it
    with pytest.raises(ConfigError, match="PAGEDSERVE_BF16_F32_ROWS"):
        bf16_gemm.float32_from_rows()
