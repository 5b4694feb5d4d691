"""int8 KV cache: the row format against plain torch, and every attention path reading int8 pools
against the float32 reference over random paged layouts (test_attention.make_step)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.gpu_worker.attention import kv_quant
from pagedserve.services.gpu_worker.attention.block_copy import copy_blocks
from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend
from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.kv_pool import KVPool, bytes_per_block
from pagedserve.shared.model_config import ModelConfig
from tests.gpu_worker.test_attention import _cpu_meta, _prefill_kernel_supported, make_step, steps

# the kernels sum in another order than the reference and quantize the query to int16 (2^-16 of a
# group max, about 4e-5 on these values); bf16 queries round the output
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def int8_step(**step):
    meta, cache, q, k, v = make_step(**step)
    return meta, kv_quant.quantize(cache), q, k, v


def check_int8_against_reference(backend, meta, cache, q, k, v):
    """write_kv stores exactly quantize(k), quantize(v); attend matches float32 attention over the
    dequantized pool (the reference reading int8 equals the reference reading its float32 copy)."""
    scale = q.shape[-1] ** -0.5
    ref_cache, cache = cache.cpu().clone(), cache.clone()
    reference, cpu_meta = ReferenceBackend(), _cpu_meta(meta)
    reference.write_kv(k.cpu(), v.cpu(), ref_cache, cpu_meta)
    backend.write_kv(k, v, cache, meta)
    assert torch.equal(cache.cpu(), ref_cache)
    slots = cpu_meta.slot_mapping
    flat = ref_cache.view(2, -1, *ref_cache.shape[3:])
    assert torch.equal(flat[0, slots], kv_quant.quantize(k.cpu())) and torch.equal(flat[1, slots], kv_quant.quantize(v.cpu()))
    expected = reference.attend(q.cpu(), ref_cache, cpu_meta, scale)
    dense = reference.attend(q.cpu(), kv_quant.dequantize(ref_cache), cpu_meta, scale)
    torch.testing.assert_close(expected, dense, atol=0, rtol=0)
    got = backend.attend(q, cache, meta, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.cpu().float(), expected.float(), **TOLERANCE[q.dtype])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.sampled_from([2, 8, 32, 64, 96, 128]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_rows_round_trip_within_half_a_step(tokens, heads, head_dim, dtype, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    # per-channel magnitudes over 3 decades: outlier channels, as K has
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * magnitude
         * 10 ** (3 * torch.rand(head_dim, generator=gen) - 3)).to(dtype)
    rows = kv_quant.quantize(x)
    width = head_dim + kv_quant.scale_bytes(head_dim)
    assert rows.dtype == torch.int8 and rows.shape == (tokens, heads, width) and kv_quant.head_dim_of(rows) == head_dim
    group = kv_quant.group_size(head_dim)
    assert group == (32 if head_dim % 32 == 0 else head_dim)
    scale = kv_quant.scales(rows)  # [tokens, heads, groups]
    absmax = x.float().unflatten(-1, (-1, group)).abs().amax(-1)
    # each group's scale is its max|x| / 127 rounded up to 12 bits (4 mantissa bits): nothing clips
    assert bool((scale >= absmax / 127).all()) and bool((scale <= absmax / 127 * (1 + 2**-4 + 2**-20) + 2**-126).all())
    assert rows[..., :head_dim].abs().max() <= 127
    err = (kv_quant.dequantize(rows) - x.float()).abs()
    assert bool((err <= scale.repeat_interleave(group, -1) * 0.5).all())


def test_twelve_bit_scales_pack_in_pairs_little_endian():
    x = torch.zeros(1, 128)
    x[0, [0, 32, 64, 96]] = torch.tensor([127.0, 254.0, 127 * 2.0**-10, 127 * 1.5])  # scales 1, 2, 2**-10, 1.5
    rows = kv_quant.quantize(x)
    bits = [0x7F0, 0x800, 0x750, 0x7F8]  # float32 bits >> 19 of 1, 2, 2**-10, 1.5
    pairs = [bits[0] | bits[1] << 12, bits[2] | bits[3] << 12]
    assert rows[0, 128:].view(torch.uint8).tolist() == [p >> s & 0xFF for p in pairs for s in (0, 8, 16)]
    assert kv_quant.scales(rows).tolist() == [[1.0, 2.0, 2.0**-10, 1.5]]
    assert rows[0, [0, 32, 64, 96]].tolist() == [127, 127, 127, 127]


def test_zero_rows_stay_zero_and_finite():
    rows = kv_quant.quantize(torch.zeros(2, 3, 64))
    assert torch.equal(kv_quant.dequantize(rows), torch.zeros(2, 3, 64))
    never_written = torch.zeros(4, 3, 67, dtype=torch.int8)
    assert torch.equal(kv_quant.dequantize(never_written), torch.zeros(4, 3, 64))


def test_cache_dtype_and_row_width():
    assert kv_quant.cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_quant.cache_dtype("int8", torch.float32) is torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant.cache_dtype("fp8", torch.float32)
    assert kv_quant.row_width(64, torch.int8) == 67 and kv_quant.row_width(64, torch.bfloat16) == 64


def test_int8_pool_holds_more_than_1_9x_the_blocks_of_bf16():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; 67 bytes per row (64 values, two 12-bit scales) against 128
    model = ModelConfig(vocab_size=10, hidden_size=576, intermediate_size=8, num_layers=30, num_heads=9,
                        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None)
    budget = 256 << 20
    bf16, int8 = (budget // bytes_per_block(model, 16, d) for d in (torch.bfloat16, torch.int8))
    assert bytes_per_block(model, 16, torch.int8) == 2 * 30 * 16 * 3 * 67
    assert int8 / bf16 >= 1.9 and budget // bytes_per_block(model, 16, torch.float32) * 3.8 <= int8
    pool = KVPool(model, 4, 16, torch.int8)
    assert pool.kv_caches[0].shape == (2, 4, 16, 3, 67) and pool.kv_caches[0].dtype == torch.int8
    assert pool.num_bytes == 4 * bytes_per_block(model, 16, torch.int8)


@settings(max_examples=30, deadline=None)
@given(steps())
def test_int8_random_layouts_match_reference(step):
    for use_kernel in (False, True):
        check_int8_against_reference(TorchPagedBackend(use_kernel), *int8_step(**step))


@pytest.mark.parametrize("use_kernel", [False, True], ids=["sdpa", "cpu-kernels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_real_model_shape_mixed_batch(dtype, use_kernel):
    requests = [(1, 200), (1, 137), (1, 1), (1, 16), (1, 17), (37, 100), (20, 20), (1, 63)]
    step = int8_step(requests=requests, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                     shared_blocks=8, seed=3)
    check_int8_against_reference(TorchPagedBackend(use_kernel), *step)


# (block_size not a multiple of 16 and head_dim 96: the AVX-512 int8 walk's tails and its AVX2 fallback)
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 1), (32, 128, 2), (16, 128, 8), (48, 64, 4),
                                                      (24, 64, 3), (5, 128, 5), (2, 64, 7), (20, 96, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_decode_kernel_over_block_sizes_head_dims_and_groups(dtype, block_size, head_dim, group):
    requests = [(1, 1), (1, 16), (1, 17), (1, block_size), (1, 3 * block_size - 5), (1, 211)]
    step = int8_step(requests=requests, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, dtype=dtype, seed=block_size + head_dim + group)
    backend = TorchPagedBackend(use_kernel=True)
    check_int8_against_reference(backend, *step)
    assert backend._plan.kernel_decodes is not None and backend._plan.decodes == []


@settings(max_examples=12, deadline=None)
@given(st.sampled_from([64, 128]), st.sampled_from([1, 3, 16, 17]), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_int8_decode_kernel_keeps_each_groups_scale(head_dim, block_size, group, seed):
    # each group of 32 channels its own magnitude (K 4x apart, V 4 decades), so a value multiplied by
    # another group's scale (the lane order of the widened K and V) shows; bf16 queries: int16 ones
    # lose 2^-16 of a group's max|q| x the largest K, past float32's 1e-4
    requests = [(1, 1), (1, 15), (1, 33), (1, 70)]
    meta, cache, q, k, v = make_step(requests, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                                     head_dim=head_dim, dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    k_mag = (2 ** (2 * torch.rand(head_dim // 32, generator=gen) - 1)).repeat_interleave(32)
    v_mag = (10 ** (4 * torch.rand(head_dim // 32, generator=gen) - 2)).repeat_interleave(32)
    cache = torch.stack([cache[0] * k_mag, cache[1] * v_mag])
    step = (meta, kv_quant.quantize(cache.bfloat16()), q.bfloat16(), (k * k_mag).bfloat16(), (v * v_mag).bfloat16())
    check_int8_against_reference(TorchPagedBackend(use_kernel=True), *step)


@pytest.mark.skipif(not _prefill_kernel_supported(), reason="the bf16 prefill kernel needs AVX-512 BF16")
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 3), (32, 128, 2)])
def test_int8_prefills_run_the_prefill_kernel_on_the_int8_pool(block_size, head_dim, group):
    # chunks after cached context (one shares its first blocks with another), a fresh prefill
    requests = [(37, 100), (20, 60), (45, 45), (1, 63)]
    step = int8_step(requests=requests, block_size=block_size, num_heads=2 * group, num_kv_heads=2,
                     head_dim=head_dim, dtype=torch.bfloat16, shared_blocks=1, seed=block_size + group)
    backend = TorchPagedBackend(use_kernel=True)
    check_int8_against_reference(backend, *step)
    assert backend._plan.kernel_prefills is not None and backend._plan.prefills == []
    # the kernel's pass 1 dequantizes to exactly the bf16 that the pool's torch dequantization gives
    meta, cache, q, k, v = step
    backend.write_kv(k, v, cache, meta)
    scale, prefill_rows = head_dim ** -0.5, 37 + 20 + 45  # the decode last: int8 and bf16 walks differ
    got = backend.attend(q, cache, meta, scale)[:prefill_rows]
    assert torch.equal(got, backend.attend(q, kv_quant.dequantize(cache, torch.bfloat16), meta, scale)[:prefill_rows])


@pytest.mark.skipif(cpu_extensions.load("decode") is None, reason="the C++ kernels are not built here")
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.sampled_from([32, 48, 64, 96, 128, 256]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.floats(1e-30, 1e6), st.integers(0, 2**31 - 1))
def test_write_kernel_stores_exactly_the_torch_quantized_rows(tokens, heads, head_dim, dtype, magnitude, seed):
    gen = torch.Generator().manual_seed(seed)
    # outlier channels over 3 decades; a quarter of the values on half steps (ties round to even)
    x = (torch.randn(2, tokens, heads, head_dim, generator=gen) * magnitude
         * 10 ** (3 * torch.rand(head_dim, generator=gen) - 3))
    ties = torch.rand(x.shape, generator=gen) < 0.25
    x = torch.where(ties, (torch.randint(-254, 255, x.shape, generator=gen) + 0.5) * magnitude / 254, x)
    x[:, :, 0] = 0  # a zero row: smallest scale, zeros
    # K and V as views of one fused row per token (strided rows, as the model's qkv split gives)
    fused = torch.cat([x[0].flatten(1), torch.zeros(tokens, 5), x[1].flatten(1)], dim=1).to(dtype)
    key = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    value = fused[:, heads * head_dim + 5 :].view(tokens, heads, head_dim)
    pool = torch.zeros(2, 3, 4, heads, kv_quant.row_width(head_dim, torch.int8), dtype=torch.int8)
    slots = torch.randperm(12, generator=gen)[:tokens]  # scattered over 3 blocks of 4
    cpu_extensions.load("decode").write_kv_int8(key, value, pool, slots)
    flat = pool.view(2, 12, heads, -1)
    assert torch.equal(flat[0, slots], kv_quant.quantize(key)) and torch.equal(flat[1, slots], kv_quant.quantize(value))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()


def test_copy_on_write_copies_int8_rows_with_their_scales():
    meta, cache, q, k, v = int8_step(requests=[(1, 40)], block_size=16, num_heads=3, num_kv_heads=3, head_dim=64,
                                     dtype=torch.bfloat16, seed=21)
    src, dst = meta.block_tables[0, :2].tolist(), [cache.shape[1] - 1, cache.shape[1] - 2]
    layers = [cache.clone(), cache.clone()]
    copy_blocks(layers, list(zip(src, dst, strict=True)))
    for layer in layers:
        assert torch.equal(layer[:, dst], cache[:, src])
        assert torch.equal(kv_quant.dequantize(layer[:, dst]), kv_quant.dequantize(cache[:, src]))
