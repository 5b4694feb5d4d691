"""cpu_gemv_wide.h's linears (bf16 pairs, Q4_1 widened; up to 64 rows) against the float32 reference and
the few-row kernel, and PackedLinear's routing to them without AMX."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.linear import PackedLinear, amx_nibbles, rows_alone
from tests.gpu_worker.gguf_factories import q4_1_blocks, q8_0_blocks
from tests.gpu_worker.test_cpu_gemv import BF16, _assert_within_one_bf16_step, _q4, _rand
from tests.gpu_worker.test_cpu_gemv_amx import _Spy

gemv = cpu_extensions.load("gemv")
pytestmark = pytest.mark.skipif(gemv is None or not gemv.supported() or not gemv.max_wide_rows(),
                                reason="needs the cpu_gemv build and AVX-512 BF16")
MAX_ROWS = 64
SHAPES = [(32, 32), (80, 576), (48, 1536)]  # 80: five blocks, the last pair one block


@pytest.mark.parametrize("kind", ["pairs", "q4"])
@pytest.mark.parametrize("num_rows", [1, 9, 12, 13, 16, 25, 64])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_wide_linears_equal_float32_reference_rounded(kind, num_rows, out_features, in_features):
    if kind == "q4":
        blocks = q4_1_blocks(out_features, in_features, seed=out_features)
        weight, args = gguf_blocks.dequantize(*blocks).to(BF16), _q4(blocks)
    else:
        weight = _rand(out_features, in_features, seed=out_features)
        args = (gemv.pack(weight),)
    x = _rand(num_rows, in_features + 16, seed=num_rows)[:, 8:-8]  # strided rows in and out
    out = torch.zeros(num_rows, out_features + 32, dtype=BF16)
    (gemv.linear_q4_wide if kind == "q4" else gemv.linear_wide)(out[:, 16:-16], x, *args)
    _assert_within_one_bf16_step(out[:, 16:-16], x, weight)
    assert not out[:, :16].any() and not out[:, -16:].any()


@pytest.mark.parametrize("kernels", ["wide", "amx"])
@pytest.mark.parametrize("num_rows", [9, 31, 64])
def test_widened_q4_1_is_the_bf16_weight_exactly(kernels, num_rows):
    if kernels == "amx" and not gemv.max_amx_rows():
        pytest.skip("no AMX here")
    blocks = q4_1_blocks(96, 1536, seed=num_rows)
    nibbles, dm = gguf_blocks.pack_q4_1(*blocks)
    x = _rand(num_rows, 1536, seed=2)
    by_q4, by_bf16 = (torch.empty(num_rows, 96, dtype=BF16) for _ in range(2))
    getattr(gemv, f"linear_q4_{kernels}")(by_q4, x, amx_nibbles(nibbles), dm)
    getattr(gemv, f"linear_{kernels}")(by_bf16, x, gemv.pack(gguf_blocks.dequantize(*blocks).to(BF16)))
    assert torch.equal(by_q4, by_bf16)


def test_a_row_gives_the_few_row_kernels_bits_whatever_rows_share_the_call():
    weight = _rand(80, 576, seed=3)
    packed = gemv.pack(weight)
    x = _rand(MAX_ROWS, 576, seed=4)
    alone = torch.empty(MAX_ROWS, 80, dtype=BF16)
    for i in range(MAX_ROWS):
        gemv.linear(alone[i:i + 1], x[i:i + 1], packed)  # the few-row kernel, one row
    for num_rows in (1, 9, 13, 40, MAX_ROWS):
        out = torch.empty(num_rows, 80, dtype=BF16)
        gemv.linear_wide(out, x[:num_rows], packed)
        assert torch.equal(out, alone[:num_rows]), num_rows


def test_wide_refuses_bad_shapes():
    packed = gemv.pack(_rand(32, 64))
    with pytest.raises(RuntimeError, match="rows"):
        gemv.linear_wide(torch.empty(MAX_ROWS + 1, 32, dtype=BF16), _rand(MAX_ROWS + 1, 64), packed)
    with pytest.raises(RuntimeError, match="x"):
        gemv.linear_wide(torch.empty(2, 32, dtype=BF16), _rand(2, 62), packed)
    nibbles, dm = gguf_blocks.pack_q4_1(*q4_1_blocks(32, 64))
    with pytest.raises(RuntimeError, match="K/4, 32"):
        gemv.linear_q4_wide(torch.empty(2, 32, dtype=BF16), _rand(2, 64), nibbles, dm)


def test_packed_linear_takes_wide_rows_past_eight_to_64(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")
    blocks = q4_1_blocks(96, 64, seed=5)
    exact = gguf_blocks.dequantize(*blocks)
    linear = PackedLinear(exact.to(BF16), blocks=blocks)
    assert linear.wide and linear.max_gemv_rows == MAX_ROWS and linear.max_alone_rows == 8
    calls = []
    monkeypatch.setattr(linear, "gemv", _Spy(calls))
    for num_rows in (1, 8, 9, MAX_ROWS, MAX_ROWS + 1):
        x = _rand(num_rows, 64, seed=num_rows)
        _assert_within_one_bf16_step(linear(x), x, exact if num_rows <= 8 else exact.to(BF16))
    assert calls == [("linear_q4", 1), ("linear_q4", 8), ("linear_q4_wide", 9), ("linear_q4_wide", MAX_ROWS)]


def test_packed_linear_keeps_q8_rows_then_takes_wide(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")
    blocks = q8_0_blocks(96, 64, seed=7)
    exact = gguf_blocks.dequantize(*blocks)
    linear = PackedLinear(exact.to(BF16), blocks=blocks)
    assert linear.gemv_packed is not None  # the bf16 copy the wide rows read
    calls = []
    monkeypatch.setattr(linear, "gemv", _Spy(calls))
    for num_rows in (8, 9, 16):
        x = _rand(num_rows, 64, seed=num_rows)
        _assert_within_one_bf16_step(linear(x), x, exact if num_rows <= 8 else exact.to(BF16))
    assert calls == [("linear_q8", 8), ("linear_wide", 9), ("linear_wide", 16)]


def test_verifying_rows_stay_off_the_wide_loops(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")
    blocks = q4_1_blocks(96, 64, seed=5)
    linear = PackedLinear(gguf_blocks.dequantize(*blocks).to(BF16), blocks=blocks)
    calls = []
    monkeypatch.setattr(linear, "gemv", _Spy(calls))
    rows_alone(True)
    try:
        linear(_rand(7, 64))
        linear(_rand(9, 64))  # past the few-row kernels' 8 rows: oneDNN
    finally:
        rows_alone(False)
    assert calls == [("linear_q4", 7)]


def test_wide_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")
    monkeypatch.setenv("PAGEDSERVE_WIDE_GEMV", "0")
    linear = PackedLinear(_rand(32, 64))
    assert not linear.wide and linear.max_gemv_rows == 8
    monkeypatch.delenv("PAGEDSERVE_WIDE_GEMV")
    assert not PackedLinear(_rand(32, 48)).wide  # K not a multiple of 32 either way
