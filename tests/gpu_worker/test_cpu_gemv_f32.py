"""The few-row float32 linears (cpu_gemv_f32.cpp, AVX2: GGUF Q4_1 and Q8_0 blocks) against a
float64 reference, PackedLinear's routing to them, and the float32 model taking them.

The kernels multiply by the blocks' exact values and sum in float32 per 32-k group: the
result is the float64 reference give or take float32 rounding over the terms' magnitudes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.linear import F32_MANY_ROWS, PackedLinear, f32_few_rows, packing_enabled
from pagedserve.services.gpu_worker.model.llama import build_model
from tests.gpu_worker.gguf_factories import q4_1_blocks, q8_0_blocks

gemv = cpu_extensions.load("gemv_f32")
pytestmark = pytest.mark.skipif(gemv is None or not gemv.supported(),
                                reason="cpu_gemv_f32 needs a C++ build and AVX2, FMA and F16C")


def _assert_close_to_float64(out, x, blocks):
    q, d, *m = (t.double() for t in blocks)
    ref = x.double() @ gguf_blocks.dequantize(*blocks).double().T
    # float32 sums, in groups: d * sum(x q) (+ m * sum(x)); bound by the terms' magnitudes
    terms = (d.repeat_interleave(32, 1) * q).abs() + (m[0].abs().repeat_interleave(32, 1) if m else 0)
    magnitude = x.double().abs() @ terms.T
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out.double() - ref).abs() <= 4 * x.shape[1] * 2.0 ** -24 * magnitude + 1e-30).all()


# kind: (random blocks, packing, kernel)
KINDS = {"q4_1": (q4_1_blocks, gguf_blocks.pack_q4_1, "linear_q4"), "q8_0": (q8_0_blocks, gguf_blocks.pack_q8_0, "linear_q8")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_rows", range(1, 9))
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (80, 576), (960, 576), (48, 1536)])
def test_float32_rows_match_float64_reference(kind, num_rows, out_features, in_features):
    factory, pack, kernel = KINDS[kind]
    blocks = factory(out_features, in_features, seed=out_features)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows))
    out = torch.empty(num_rows, out_features)
    getattr(gemv, kernel)(out, x, *pack(*blocks))
    _assert_close_to_float64(out, x, blocks)


def test_linear_q4_float32_reads_strided_rows_and_refuses_mixed_dtypes():
    blocks = q4_1_blocks(32, 64, seed=7)
    packed = gguf_blocks.pack_q4_1(*blocks)
    x = torch.randn(3, 80)[:, 8:72]  # rows 80 apart
    out = torch.zeros(3, 48)
    gemv.linear_q4(out[:, 8:40], x, *packed)
    _assert_close_to_float64(out[:, 8:40], x, blocks)
    assert not out[:, :8].any() and not out[:, 40:].any()
    with pytest.raises(RuntimeError, match="float32"):
        gemv.linear_q4(torch.empty(1, 32, dtype=torch.bfloat16), torch.randn(1, 64), *packed)
    with pytest.raises(RuntimeError, match="rows"):
        gemv.linear_q4(torch.empty(9, 32), torch.randn(9, 64), *packed)


def test_float32_packed_linear_routes_rows_by_count(monkeypatch):
    blocks = q4_1_blocks(96, 64, seed=3)
    weight = gguf_blocks.dequantize(*blocks)
    linear = PackedLinear(weight, blocks=blocks)
    assert (linear.packed is not None) == packing_enabled(weight)
    few = f32_few_rows()
    assert linear.gemv_q4 is not None and linear.max_gemv_rows == few and few in (4, 8)
    assert linear.max_many_rows == F32_MANY_ROWS
    calls = []
    spy = type("Spy", (), {
        "linear_q4": lambda self, *a: calls.append(("q4", a[1].shape[0])) or gemv.linear_q4(*a),
        "linear_many": lambda self, *a: calls.append(("many", a[1].shape[0])) or gemv.linear_many(*a)})()
    monkeypatch.setattr(linear, "gemv", spy)
    for num_rows in (1, few, few + 1, 64, F32_MANY_ROWS, F32_MANY_ROWS + 1):
        x = torch.randn(num_rows, 64)
        _assert_close_to_float64(linear(x), x, blocks)
    assert calls == [("q4", 1), ("q4", few), ("many", few + 1), ("many", 64), ("many", F32_MANY_ROWS)]
    # no blocks, or blocks of another weight: no few-row kernel
    assert PackedLinear(weight).gemv is None and PackedLinear(weight * 2, blocks=blocks).gemv is None
    monkeypatch.setenv("PAGEDSERVE_SMALL_M_GEMV", "0")
    assert PackedLinear(weight, blocks=blocks).gemv is None


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(num_rows=st.integers(1, 40), num_blocks=st.integers(1, 5), num_groups=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_many_rows_match_float64_reference(kind, num_rows, num_blocks, num_groups, seed):
    """Any row count (6-row register tiles and their remainders), K across 256-k chunks."""
    factory, pack, _ = KINDS[kind]
    blocks = factory(16 * num_blocks, 32 * num_groups, seed=seed)
    x = torch.randn(num_rows, 32 * num_groups + 16, generator=torch.Generator().manual_seed(seed))[:, 16:]
    out = torch.full((num_rows, 16 * num_blocks + 8), 7.0)
    gemv.linear_many(out[:, :-8], x, *pack(*blocks))
    _assert_close_to_float64(out[:, :-8], x, blocks)
    assert (out[:, -8:] == 7.0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_linear_many_gives_a_row_the_same_bits_whatever_rows_share_the_call(kind):
    """Its tiles of up to six rows, K in 256-k chunks: each row sums in k order, whatever tile it is in."""
    factory, pack, _ = KINDS[kind]
    packed = pack(*factory(48, 576, seed=11))
    x = torch.randn(14, 576, generator=torch.Generator().manual_seed(5))
    alone = torch.empty(14, 48)
    for i in range(14):
        gemv.linear_many(alone[i:i + 1], x[i:i + 1], *packed)
    for num_rows in range(2, 15):
        out = torch.empty(num_rows, 48)
        gemv.linear_many(out, x[:num_rows], *packed)
        assert torch.equal(out, alone[:num_rows]), num_rows


def test_linear_many_refuses_bad_shapes():
    packed = gguf_blocks.pack_q8_0(*q8_0_blocks(32, 64, seed=5))
    with pytest.raises(RuntimeError, match="rows"):
        gemv.linear_many(torch.empty(0, 32), torch.randn(0, 64), *packed)
    with pytest.raises(RuntimeError, match="float32"):
        gemv.linear_many(torch.empty(2, 32), torch.randn(2, 64).bfloat16(), *packed)


def test_float32_packed_linear_takes_q8_blocks_for_few_rows():
    blocks = q8_0_blocks(48, 64, seed=4)
    linear = PackedLinear(gguf_blocks.dequantize(*blocks), blocks=blocks)
    assert linear.gemv_q8 is not None and linear.gemv_q4 is None
    for num_rows in (1, 3, 9):
        x = torch.randn(num_rows, 64)
        _assert_close_to_float64(linear(x), x, blocks)


def test_float32_model_takes_the_gguf_blocks_for_every_projection_and_the_head():
    model = build_model("smollm2", dtype=torch.float32)
    for layer in model.layers:
        assert all(p.gemv_q4 is not None for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert model.head.gemv_q8 is not None  # the tied embedding, Q8_0 in the GGUF


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(kind):
    """Up to the few-row kernels' most rows (a verification step's), both block kinds alike."""
    blocks = KINDS[kind][0](80, 576, seed=9)
    linear = PackedLinear(gguf_blocks.dequantize(*blocks), blocks=blocks)
    few = f32_few_rows()
    assert linear.max_gemv_rows == few
    x = torch.randn(few, 576, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([linear(x[i:i + 1]) for i in range(few)])
    for num_rows in range(2, few + 1):
        assert torch.equal(linear(x[:num_rows]), alone[:num_rows]), num_rows
