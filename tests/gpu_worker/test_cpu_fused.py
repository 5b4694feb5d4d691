"""The fused CPU kernels (cpu_fused.cpp, bf16 and float32) against the torch op chains they
replace.

Products and sums are bit-identical (every bf16 rounding torch does is done too); RMSNorm
(the order of its float sum) and SiLU (a different vector exp: about 1 in 1000 results)
may land one bf16 step away (SwiGLU's product then up to two). In float32 the same holds
with a float32 ulp for the step, and rotary may differ by an ulp where the compiler fuses a
product and a sum into an FMA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model.llama import RMSNorm
from pagedserve.services.gpu_worker.model.rotary_embedding import _rotate

fused = cpu_extensions.load("fused")
pytestmark = pytest.mark.skipif(fused is None, reason="the C++ kernels could not be built here")
BF16 = torch.bfloat16
DTYPES = [BF16, torch.float32]


def _rand(*shape, seed=0, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _plain_norm(x, weight, eps):
    norm = RMSNorm(x.shape[1], eps, x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def _within_steps(actual, expected, steps=1):
    """steps bf16 steps (2^-7 relative) or, in float32, float32 ulps (2^-23) times 4."""
    assert actual.dtype == expected.dtype
    rtol = steps * (2**-7 if actual.dtype == BF16 else 4 * 2**-23)
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 300])
def test_rms_norm(num_rows, dtype):
    x, weight = _rand(num_rows, 576, seed=1, scale=3, dtype=dtype), _rand(576, seed=2, dtype=dtype)
    out = torch.empty_like(x)
    fused.rms_norm(out, x, weight, 1e-5)
    _within_steps(out, _plain_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 300])
def test_add_rms_norm_updates_the_residual(num_rows, dtype):
    x, residual = _rand(num_rows, 64, seed=3, dtype=dtype), _rand(num_rows, 64, seed=4, dtype=dtype)
    weight = _rand(64, seed=5, dtype=dtype)
    expected_sum = residual + x
    out = torch.empty_like(x)
    fused.add_rms_norm(out, residual, x, weight, 1e-6)
    assert torch.equal(residual, expected_sum)
    _within_steps(out, _plain_norm(expected_sum, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 300])
def test_silu_and_mul(num_rows, dtype):
    gate_up = _rand(num_rows, 2 * 1536, seed=6, scale=4, dtype=dtype)
    out = torch.empty(num_rows, 1536, dtype=dtype)
    fused.silu_and_mul(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    _within_steps(out, F.silu(gate) * up, steps=2)  # silu's step, then the product's


def test_mixed_dtypes_are_refused():
    out = torch.empty(2, 64)
    with pytest.raises(RuntimeError, match="one dtype"):
        fused.rms_norm(out, _rand(2, 64), _rand(64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype):
    # q and k are views of one fused qkv row, as in the model: rows strided, heads contiguous
    num_tokens, heads, kv_heads, dim = 7, 9, 3, 64
    qkv = _rand(num_tokens, (heads + 2 * kv_heads) * dim, seed=7, dtype=dtype)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    positions = torch.tensor([0, 1, 2, 50, 51, 999, 3], dtype=torch.int64)
    angles = torch.arange(1024).float()[:, None] * torch.rand(dim // 2, generator=torch.Generator().manual_seed(8))
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    expected_q, expected_k = _rotate(q, c, s), _rotate(k, c, s)
    untouched_v = qkv[:, (heads + kv_heads) * dim :].clone()
    fused.rotary(q, positions, cos, sin)
    fused.rotary(k, positions, cos, sin)
    if dtype == BF16:
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    _within_steps(q, expected_q), _within_steps(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], untouched_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_is_torch_max_indices_first_on_ties(dtype):
    logits = _rand(37, 49152, seed=9, scale=5, dtype=dtype)
    logits[3, 100] = logits[3, 7] = logits[3].max() + 1  # a tie: the first index wins
    logits[5] = 0.0  # a row of equal values: index 0
    expected = logits.float().max(dim=1).indices
    assert torch.equal(fused.argmax_rows(logits), expected)
    assert fused.argmax_rows(logits)[3].item() == 7 and fused.argmax_rows(logits)[5].item() == 0


@pytest.mark.parametrize("int8_pool", [False, True], ids=["model-dtype-pool", "int8-pool"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_is_rotary_then_write_kv(dtype, int8_pool):
    from pagedserve.services.gpu_worker.attention.kv_quant import quantize
    from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
    from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend

    num_tokens, heads, kv_heads, dim, block_size = 6, 9, 3, 64, 4
    qkv = _rand(num_tokens, (heads + 2 * kv_heads) * dim, seed=10, dtype=dtype)
    views = lambda t: (t[:, : heads * dim].view(num_tokens, heads, dim),  # noqa: E731
                       t[:, heads * dim : (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim),
                       t[:, (heads + kv_heads) * dim :].view(num_tokens, kv_heads, dim))
    meta = AttentionMetadata.build([4, 2], [9, 2], [[5, 0, 3], [7]], block_size)
    positions = AttentionMetadata.positions(meta)
    angles = torch.arange(64).float()[:, None] * torch.rand(dim // 2, generator=torch.Generator().manual_seed(11))
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    cache = _rand(2, 8, block_size, kv_heads, dim, seed=12, dtype=dtype)
    cache = quantize(cache) if int8_pool else cache  # int8: each row quantized as written, torch's bytes
    expected_qkv, expected_cache = qkv.clone(), cache.clone()
    eq, ek, ev = views(expected_qkv)
    fused.rotary(eq, positions, cos, sin)
    fused.rotary(ek, positions, cos, sin)
    ReferenceBackend().write_kv(ek, ev, expected_cache, meta)
    fused.rope_write_kv(*views(qkv), positions, cos, sin, cache, meta.slot_mapping)
    assert torch.equal(qkv, expected_qkv) and torch.equal(cache, expected_cache)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused.rope_write_kv(*views(qkv), positions, cos, sin, cache, meta.slot_mapping + 1000)
