"""The few-row bf16 linears (cpu_gemv.cpp: bf16 weights, GGUF Q4_1 and Q8_0 blocks) against a
float32 reference, and PackedLinear's routing to them.

Each product of two bf16 is exact in float32 and the kernel sums in float32, so its result
is the float32 reference rounded to bf16, give or take one bf16 step where the two sum
orders round apart.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.linear import PackedLinear, amx_nibbles, q8_pairs
from pagedserve.services.gpu_worker.model.llama import build_model
from tests.gpu_worker.gguf_factories import q4_1_blocks, q8_0_blocks

gemv = cpu_extensions.load("gemv")
pytestmark = pytest.mark.skipif(gemv is None or not gemv.supported(),
                                reason="cpu_gemv needs a C++ build and AVX-512 BF16")
BF16 = torch.bfloat16


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _q4(blocks):
    nibbles, dm = gguf_blocks.pack_q4_1(*blocks)
    return amx_nibbles(nibbles), dm


def _q8(blocks):
    q, d = gguf_blocks.pack_q8_0(*blocks)
    return q8_pairs(q), d


def _assert_within_one_bf16_step(out, x, weight):
    ref = x.float() @ weight.float().T
    # one bf16 step at each value's magnitude, plus what float32 sums in another order may
    # differ by (K * 2^-24 of the sum of the terms' magnitudes: matters where terms cancel)
    magnitude = x.float().abs() @ weight.float().abs().T
    step = ref.abs() * 2.0 ** -7 + x.shape[1] * 2.0 ** -24 * magnitude
    assert out.dtype == BF16 and out.shape == ref.shape
    assert ((out.float() - ref).abs() <= step).all()
    assert (out == ref.to(BF16)).float().mean() > 0.95  # mostly the float32 result, rounded


def test_pack_layout_is_pairs_of_k_for_16_outputs():
    weight = torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4).to(BF16)
    packed = gemv.pack(weight)
    assert packed.shape == (2, 2, 16, 2)
    # block 1 (outputs 16..31), k pair 1 (k = 2, 3), output 16 + 5
    assert packed[1, 1, 5].tolist() == weight[21, 2:4].tolist()


@pytest.mark.parametrize("num_rows", range(1, 9))
@pytest.mark.parametrize("out_features, in_features", [(16, 2), (48, 576), (960, 576), (80, 1536)])
def test_linear_equals_float32_reference_rounded(num_rows, out_features, in_features):
    weight = _rand(out_features, in_features, seed=out_features)
    x = _rand(num_rows, in_features, seed=num_rows)
    out = torch.empty(num_rows, out_features, dtype=BF16)
    gemv.linear(out, x, gemv.pack(weight))
    _assert_within_one_bf16_step(out, x, weight)


def test_linear_reads_strided_rows_and_writes_strided_rows():
    weight = _rand(64, 32)
    x = _rand(3, 40)[:, 4:36]  # rows 40 apart
    out = torch.zeros(3, 80, dtype=BF16)
    gemv.linear(out[:, 8:72], x, gemv.pack(weight))
    _assert_within_one_bf16_step(out[:, 8:72], x, weight)
    assert not out[:, :8].any() and not out[:, 72:].any()


def test_linear_refuses_bad_shapes():
    packed = gemv.pack(_rand(32, 8))
    with pytest.raises(RuntimeError, match="rows"):
        gemv.linear(torch.empty(9, 32, dtype=BF16), _rand(9, 8), packed)
    with pytest.raises(RuntimeError, match="x"):
        gemv.linear(torch.empty(1, 32, dtype=BF16), _rand(1, 6), packed)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        gemv.pack(_rand(20, 8))


def test_packed_linear_takes_few_rows_to_gemv_and_many_to_onednn(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")  # the few AVX-512 rows (test_cpu_gemv_amx.py: AMX's,
    monkeypatch.setenv("PAGEDSERVE_WIDE_GEMV", "0")  # test_cpu_gemv_wide.py: many rows)
    weight = _rand(96, 64, seed=3)
    linear = PackedLinear(weight)
    assert linear.max_gemv_rows == gemv.max_rows() == 8
    calls = []
    monkeypatch.setattr(linear, "gemv", type("Spy", (), {"linear": lambda self, *a: calls.append(a) or gemv.linear(*a)})())
    for num_rows in (1, 8, 9, 64):
        x = _rand(num_rows, 64, seed=num_rows)
        _assert_within_one_bf16_step(linear(x), x, weight)
    assert [a[1].shape[0] for a in calls] == [1, 8]


def test_small_m_path_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_SMALL_M_GEMV", "0")
    linear = PackedLinear(_rand(32, 8))
    assert linear.gemv is None and linear.max_gemv_rows == 0
    assert PackedLinear(_rand(20, 8)).gemv is None  # not a multiple of 16 either way


# ---- Q4_1 weights --------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", range(1, 9))
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (80, 576), (960, 576), (48, 1536)])
def test_linear_q4_equals_float32_reference_rounded(num_rows, out_features, in_features):
    blocks = q4_1_blocks(out_features, in_features, seed=out_features)
    weight = gguf_blocks.dequantize(*blocks)
    x = _rand(num_rows, in_features, seed=num_rows)
    out = torch.empty(num_rows, out_features, dtype=BF16)
    gemv.linear_q4(out, x, *_q4(blocks))
    _assert_within_one_bf16_step(out, x, weight)


def test_packed_linear_reads_q4_blocks_only_where_they_are_the_weight():
    blocks = q4_1_blocks(64, 64, seed=5)
    weight = gguf_blocks.dequantize(*blocks).to(BF16)
    linear = PackedLinear(weight, blocks=blocks)
    assert linear.gemv_q4 is not None and linear.gemv_packed is None  # no bf16 copy kept
    x = _rand(2, 64)
    _assert_within_one_bf16_step(linear(x), x, gguf_blocks.dequantize(*blocks))
    other = PackedLinear(weight * 2, blocks=blocks)  # blocks of another weight: refused
    assert other.gemv_q4 is None and other.gemv_packed is not None
    _assert_within_one_bf16_step(other(x), x, (weight * 2).float())


def test_bf16_model_takes_q4_blocks_for_every_layer_projection():
    model = build_model("smollm2", dtype=BF16)
    for layer in model.layers:
        assert all(p.gemv_q4 is not None for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # the tied Q8_0 embedding: its blocks for the few-row calls up to the Q8_0 kernel's rows; a bf16
    # pairs copy where AMX tiles or the wide loops take the rows past them
    assert model.head.gemv_q8 is not None
    assert (model.head.gemv_packed is not None) == (model.head.amx or model.head.wide)
    assert model.head.max_q8_rows == gemv.max_rows()


# ---- Q8_0 weights --------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows", range(1, 9))
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (80, 576), (960, 576), (48, 1536)])
def test_linear_q8_equals_float32_reference_rounded(num_rows, out_features, in_features):
    blocks = q8_0_blocks(out_features, in_features, seed=out_features)
    x = _rand(num_rows, in_features, seed=num_rows)
    out = torch.empty(num_rows, out_features, dtype=BF16)
    gemv.linear_q8(out, x, *_q8(blocks))
    _assert_within_one_bf16_step(out, x, gguf_blocks.dequantize(*blocks))


def test_linear_q8_reads_strided_rows_and_writes_strided_rows():
    blocks = q8_0_blocks(32, 64, seed=2)
    x = _rand(3, 80)[:, 8:72]  # rows 80 apart
    out = torch.zeros(3, 48, dtype=BF16)
    gemv.linear_q8(out[:, 8:40], x, *_q8(blocks))
    _assert_within_one_bf16_step(out[:, 8:40], x, gguf_blocks.dequantize(*blocks))
    assert not out[:, :8].any() and not out[:, 40:].any()


def test_linear_q8_refuses_bad_inputs():
    q, d = _q8(q8_0_blocks(32, 64))
    with pytest.raises(RuntimeError, match="rows"):
        gemv.linear_q8(torch.empty(9, 32, dtype=BF16), _rand(9, 64), q, d)
    with pytest.raises(RuntimeError, match="x"):
        gemv.linear_q8(torch.empty(1, 32, dtype=BF16), _rand(1, 32), q, d)
    with pytest.raises(RuntimeError, match="x"):
        gemv.linear_q8(torch.empty(1, 32, dtype=BF16), _rand(1, 64).float(), q, d)
    with pytest.raises(RuntimeError, match="q8_pairs"):
        gemv.linear_q8(torch.empty(1, 32, dtype=BF16), _rand(1, 64), q.view(torch.uint8), d)


def test_packed_linear_takes_q8_blocks_for_few_rows_and_onednn_for_more(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")
    monkeypatch.setenv("PAGEDSERVE_WIDE_GEMV", "0")
    blocks = q8_0_blocks(96, 64, seed=7)
    exact = gguf_blocks.dequantize(*blocks)
    linear = PackedLinear(exact.to(BF16), blocks=blocks)
    assert linear.gemv_q8 is not None and linear.gemv_packed is None and linear.max_q8_rows == 8
    calls = []

    class Spy:
        def linear_q8(self, *a):
            calls.append(a[1].shape[0])
            gemv.linear_q8(*a)

    monkeypatch.setattr(linear, "gemv", Spy())
    for num_rows in (1, 2, 3, 8, 9):
        x = _rand(num_rows, 64, seed=num_rows)
        # Q8_0 rows use the exact weights, oneDNN's their bf16 roundings
        _assert_within_one_bf16_step(linear(x), x, exact if num_rows <= 8 else exact.to(BF16))
    assert calls == [1, 2, 3, 8]
    other = PackedLinear(exact.to(BF16) * 2, blocks=blocks)  # blocks of another weight: refused
    assert other.gemv_q8 is None and other.max_q8_rows == 0 and other.gemv_packed is not None


# ---- batch invariance: a verification step's rows round as lone decode steps ----------------


@pytest.mark.parametrize("kind", ["pairs", "q4_1", "q8_0"])
def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(kind, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_AMX_GEMV", "0")  # AMX tiles from 2 rows sum in another order
    out_features, in_features = 80, 576
    if kind == "pairs":
        linear = PackedLinear(_rand(out_features, in_features, seed=9))
    else:
        blocks = (q4_1_blocks if kind == "q4_1" else q8_0_blocks)(out_features, in_features, seed=9)
        linear = PackedLinear(gguf_blocks.dequantize(*blocks).to(BF16), blocks=blocks)
        assert (linear.gemv_q4 if kind == "q4_1" else linear.gemv_q8) is not None
    x = _rand(8, in_features, seed=4)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(8)])
    for num_rows in range(2, 9):
        assert torch.equal(linear(x[:num_rows]), alone[:num_rows]), num_rows
