"""The AMX bf16 linears (cpu_gemv_amx.h: bf16 pairs and Q4_1 row pairs, up to 256 rows) against the
float32 reference, and PackedLinear's routing to them on a CPU with AMX."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.linear import AMX_MIN_ROWS, PackedLinear, amx_nibbles, rows_alone
from tests.gpu_worker.gguf_factories import q4_1_blocks, q8_0_blocks
from tests.gpu_worker.test_cpu_gemv import BF16, _assert_within_one_bf16_step, _rand

gemv = cpu_extensions.load("gemv")
pytestmark = pytest.mark.skipif(gemv is None or not gemv.supported() or not gemv.max_amx_rows(),
                                reason="needs the cpu_gemv build and a CPU (and OS) with AMX")
SHAPES = [(32, 32), (80, 576), (960, 576), (48, 1536)]
EXACT_ROWS = 8  # cpu_gemv_amx.h's kAmxExactRows: Q4_1 rows past it read the weight rounded to bf16


def _q4_weight(blocks, num_rows):
    exact = gguf_blocks.dequantize(*blocks)
    return exact if num_rows <= EXACT_ROWS else exact.to(BF16)


def test_amx_nibbles_are_row_pairs_of_the_pairs_layout():
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    d = torch.ones(32, 2)
    nibbles = amx_nibbles(gguf_blocks.pack_q4_1(q, d, d)[0])
    assert nibbles.shape == (2, 16, 32)
    # block 1, pair s = 3: B rows 6 and 7 (k 12, 13 and 14, 15); byte j: output 16 + j // 2
    for j in (0, 5, 31):
        n, k = 16 + j // 2, 12 + j % 2
        assert nibbles[1, 3, j] == q[n, k] | (q[n, k + 2] << 4)


@pytest.mark.parametrize("kind", ["pairs", "q4"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 7, 8, 9, 16, 17, 40, 256])
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_amx_linears_equal_float32_reference_rounded(kind, num_rows, out_features, in_features):
    if kind == "q4":
        blocks = q4_1_blocks(out_features, in_features, seed=out_features)
        nibbles, dm = gguf_blocks.pack_q4_1(*blocks)
        weight, args = _q4_weight(blocks, num_rows), (amx_nibbles(nibbles), dm)
    else:
        weight = _rand(out_features, in_features, seed=out_features)
        args = (gemv.pack(weight),)
    x = _rand(num_rows, in_features + 16, seed=num_rows)[:, 8:-8]  # strided rows in and out
    out = torch.zeros(num_rows, out_features + 32, dtype=BF16)
    (gemv.linear_q4_amx if kind == "q4" else gemv.linear_amx)(out[:, 16:-16], x, *args)
    _assert_within_one_bf16_step(out[:, 16:-16], x, weight)
    assert not out[:, :16].any() and not out[:, -16:].any()


def test_amx_refuses_bad_shapes():
    packed = gemv.pack(_rand(32, 64))
    with pytest.raises(RuntimeError, match="rows"):
        gemv.linear_amx(torch.empty(257, 32, dtype=BF16), _rand(257, 64), packed)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gemv.linear_amx(torch.empty(2, 32, dtype=BF16), _rand(2, 16), gemv.pack(_rand(32, 16)))
    nibbles, dm = gguf_blocks.pack_q4_1(*q4_1_blocks(32, 64))
    with pytest.raises(RuntimeError, match="K/4, 32"):
        gemv.linear_q4_amx(torch.empty(2, 32, dtype=BF16), _rand(2, 64), nibbles, dm)


class _Spy:
    def __init__(self, calls):
        self.calls = calls

    def __getattr__(self, name):
        def call(*a):
            self.calls.append((name, a[1].shape[0]))
            getattr(gemv, name)(*a)
        return call


def test_packed_linear_takes_amx_from_two_rows_to_256(monkeypatch):
    blocks = q4_1_blocks(96, 64, seed=5)
    linear = PackedLinear(gguf_blocks.dequantize(*blocks).to(BF16), blocks=blocks)
    assert linear.amx and linear.max_gemv_rows == 256 and AMX_MIN_ROWS == 2
    calls = []
    monkeypatch.setattr(linear, "gemv", _Spy(calls))
    for num_rows in (1, 2, 16, 17, 256, 257):
        x = _rand(num_rows, 64, seed=num_rows)
        _assert_within_one_bf16_step(linear(x), x, _q4_weight(blocks, num_rows))
    assert calls == [("linear_q4", 1), ("linear_q4_amx", 2), ("linear_q4_amx", 16), ("linear_q4_amx", 17),
                     ("linear_q4_amx", 256)]


def test_packed_linear_keeps_q8_rows_then_takes_amx(monkeypatch):
    blocks = q8_0_blocks(96, 64, seed=7)
    exact = gguf_blocks.dequantize(*blocks)
    linear = PackedLinear(exact.to(BF16), blocks=blocks)
    calls = []
    monkeypatch.setattr(linear, "gemv", _Spy(calls))
    for num_rows in (2, 8, 9, 16):
        x = _rand(num_rows, 64, seed=num_rows)
        _assert_within_one_bf16_step(linear(x), x, exact if num_rows <= 8 else exact.to(BF16))
    assert calls == [("linear_q8", 2), ("linear_q8", 8), ("linear_amx", 9), ("linear_amx", 16)]


def test_amx_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")
    linear = PackedLinear(_rand(32, 64))  # then the AVX-512 wide loops take 9-64 rows, as without AMX
    assert not linear.amx and linear.wide and linear.max_gemv_rows == gemv.max_wide_rows() == 64
    monkeypatch.setenv("PAGEDSERVE_WIDE_GEMV", "0")
    linear = PackedLinear(_rand(32, 64))
    assert not linear.amx and not linear.wide and linear.max_gemv_rows == 8
    assert not PackedLinear(_rand(32, 48)).amx  # K not a multiple of 32 either way


def test_rows_alone_sums_each_row_as_a_one_row_product(monkeypatch):
    blocks = q4_1_blocks(96, 64, seed=5)
    linear = PackedLinear(gguf_blocks.dequantize(*blocks).to(BF16), blocks=blocks)
    x = _rand(9, 64, seed=3)
    one_by_one = torch.cat([linear(x[i:i + 1]) for i in range(7)])
    calls = []
    monkeypatch.setattr(linear, "gemv", _Spy(calls))
    rows_alone(True)
    try:
        assert torch.equal(linear(x[:7]), one_by_one)
        linear(x)  # past the AVX-512 kernels' 8 rows: oneDNN
    finally:
        rows_alone(False)
    linear(x[:7])
    assert calls == [("linear_q4", 7), ("linear_q4_amx", 7)]
