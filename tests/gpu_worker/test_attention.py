"""TorchPagedBackend against the dense ReferenceBackend over random paged layouts.

make_step (also used by the Triton tests) lays every request's blocks at random, permuted,
non-contiguous places in a pool full of random stale values, optionally lets two requests
share their first blocks (a cached prefix), and produces the step's q/k/v.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.gpu_worker.attention import get_backend, torch_paged
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend

# bf16 outputs are within a few bf16 ulps of values of magnitude up to ~3
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def make_step(requests, *, block_size, num_heads, num_kv_heads, head_dim, dtype,
              shared_blocks=0, seed=0, device="cpu"):
    """requests: [(query_len, seq_len)]. Requests 0 and 1 share their first shared_blocks
    blocks, which must hold only cached context of both (new tokens go to private blocks)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [(s + block_size - 1) // block_size for _, s in requests]
    ids = list(range(sum(need) + 3))
    rng.shuffle(ids)
    tables, at = [], 0
    for i, n in enumerate(need):
        if i == 1 and shared_blocks:
            for q, s in requests[:2]:
                assert shared_blocks * block_size <= s - q, "a shared block would be written"
            tables.append(tables[0][:shared_blocks] + ids[at : at + n - shared_blocks])
            at += n - shared_blocks
        else:
            tables.append(ids[at : at + n])
            at += n
    meta = AttentionMetadata.build([q for q, _ in requests], [s for _, s in requests], tables,
                                   block_size, device=device)
    num_tokens = sum(q for q, _ in requests)
    cache = torch.randn(2, len(ids), block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return meta, cache.to(device), q.to(device), k.to(device), v.to(device)


def check_against_reference(backend, meta, cache, q, k, v, scale=None):
    """write_kv must store exactly what the reference stores; attend must match it."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref_cache, cache = cache.cpu().clone(), cache.clone()
    reference, cpu_meta = ReferenceBackend(), _cpu_meta(meta)
    reference.write_kv(k.cpu(), v.cpu(), ref_cache, cpu_meta)
    backend.write_kv(k, v, cache, meta)
    assert torch.equal(cache.cpu(), ref_cache)
    expected = reference.attend(q.cpu(), ref_cache, cpu_meta, scale)
    got = backend.attend(q, cache, meta, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.cpu().float(), expected.float(), **TOLERANCE[q.dtype])


def _cpu_meta(meta: AttentionMetadata) -> AttentionMetadata:
    if meta.block_tables.device.type == "cpu":
        return meta
    return AttentionMetadata(meta.query_start_loc.cpu(), meta.seq_lens.cpu(), meta.block_tables.cpu(),
                             meta.slot_mapping.cpu(), meta.max_query_len, meta.max_seq_len,
                             meta.query_lens_cpu, meta.seq_lens_cpu)


@st.composite
def steps(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_kv_heads, group = draw(st.sampled_from([(1, 1), (2, 2), (3, 3), (1, 4), (4, 1)]))
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        q = 1 if kind == "decode" else draw(st.integers(2, 40))
        cached = 0 if kind == "prefill" else draw(st.integers(0 if kind == "chunk" else 1, 70))
        requests.append((q, cached + q))
    shared = 0
    if len(requests) >= 2:
        room = min((s - q) // block_size for q, s in requests[:2])
        shared = draw(st.integers(0, min(room, 3)))
    return dict(requests=requests, block_size=block_size, num_heads=num_kv_heads * group,
                num_kv_heads=num_kv_heads, head_dim=draw(st.sampled_from([8, 24, 64])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), shared_blocks=shared,
                seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=30, deadline=None)
@given(steps())
def test_random_layouts_match_reference(step):
    for use_kernel in (False, True):
        check_against_reference(TorchPagedBackend(use_kernel), *make_step(**step))


@pytest.mark.parametrize("use_kernel", [False, True], ids=["sdpa-decodes", "cpu-kernel-decodes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_model_shape_mixed_batch(dtype, use_kernel):
    # 9 query heads over 3 kv heads, head_dim 64, block_size 16: decodes with contexts ending
    # mid-block, a chunk after cached context, a fresh prefill, and a shared prefix
    requests = [(1, 200), (1, 137), (1, 1), (1, 16), (1, 17), (37, 100), (20, 20), (1, 63)]
    step = make_step(requests, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                     shared_blocks=8, seed=3)
    check_against_reference(TorchPagedBackend(use_kernel), *step)


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 1), (32, 128, 2), (16, 128, 8), (48, 64, 4)])
def test_bf16_kernel_over_block_sizes_head_dims_and_groups(block_size, head_dim, group):
    # on a CPU with AVX-512 BF16 these run the vdpbf16ps path (block_size a multiple of 16,
    # head_dim 64 or 128): contexts of 1 token, a block and one past it, several blocks with
    # a partial last one, and more than one 16-token group within a block
    requests = [(1, 1), (1, 16), (1, 17), (1, block_size), (1, 3 * block_size - 5), (1, 211)]
    step = make_step(requests, block_size=block_size, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     dtype=torch.bfloat16, seed=block_size + head_dim + group)
    check_against_reference(TorchPagedBackend(use_kernel=True), *step)


def _prefill_kernel_supported() -> bool:
    from pagedserve.services.gpu_worker.kernels import cpu_extensions

    module = cpu_extensions.load("prefill")
    return module is not None and module.supported()


@pytest.fixture(params=[False, True], ids=["avx512-walk", "amx-walk"])
def prefill_walk(request):
    """The prefill kernel's vdpbf16ps walk, then its AMX walk (skipped where AMX cannot run;
    without AVX-512 BF16 the first leaves the prefills to SDPA)."""
    from pagedserve.services.gpu_worker.kernels import cpu_extensions

    module = cpu_extensions.load("prefill")
    usable = module is not None and module.supported()
    if request.param and not (usable and module.use_amx(True)):
        pytest.skip("no AMX on this CPU (or the kernel did not grant the tile state)")
    if usable:
        module.use_amx(request.param)
    yield
    if usable:
        module.use_amx(True)


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 3), (32, 128, 2), (16, 128, 8), (48, 64, 1)])
def test_bf16_prefill_kernel_over_block_sizes_head_dims_and_groups(monkeypatch, prefill_walk, block_size, head_dim,
                                                                   group):
    # fresh prompts of 2, 16, 17 tokens and one past 16-row tiles of every group size;
    # chunks after cached context ending mid-block and on a block boundary; decodes between;
    # prompts past 32 keys (AMX chunks) ending mid-chunk
    requests = [(2, 2), (16, 16), (17, 17), (1, 30), (5, 5 + block_size), (23, 23 + 3 * block_size - 7),
                (70, 211), (1, 1), (33, 33)]
    step = make_step(requests, block_size=block_size, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     dtype=torch.bfloat16, seed=block_size * head_dim + group)
    if _prefill_kernel_supported():  # every prefill must go through the kernel, not SDPA
        def no_sdpa(*args, **kwargs):
            raise AssertionError("SDPA ran where the prefill kernel should have")

        monkeypatch.setattr(torch_paged.F, "scaled_dot_product_attention", no_sdpa)
    check_against_reference(TorchPagedBackend(use_kernel=True), *step)


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 3), (32, 128, 2), (5, 128, 8), (48, 64, 1)])
def test_f32_prefill_kernel_over_block_sizes_head_dims_and_groups(monkeypatch, block_size, head_dim, group):
    # the AVX2 walk: prompts shorter and longer than a 16-key chunk and a 6-row tile, chunks after
    # cached context ending mid-block, decodes between, a prompt past several chunks
    requests = [(2, 2), (16, 16), (17, 17), (1, 30), (5, 5 + block_size), (23, 23 + 3 * block_size - 7),
                (70, 211), (1, 1), (33, 33)]
    step = make_step(requests, block_size=block_size, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                     dtype=torch.float32, seed=block_size * head_dim + group)
    from pagedserve.services.gpu_worker.kernels import cpu_extensions

    module = cpu_extensions.load("prefill")
    if module is not None and module.supported_f32():  # every prefill must go through the kernel, not SDPA
        def no_sdpa(*args, **kwargs):
            raise AssertionError("SDPA ran where the prefill kernel should have")

        monkeypatch.setattr(torch_paged.F, "scaled_dot_product_attention", no_sdpa)
    check_against_reference(TorchPagedBackend(use_kernel=True), *step)


@pytest.mark.parametrize("pad_tokens", [0, 1 << 30])
def test_decode_buckets_one_per_length_or_one_for_all(monkeypatch, pad_tokens):
    monkeypatch.setattr(torch_paged, "PAD_TOKENS_PER_CALL", pad_tokens)
    rng = random.Random(7)
    requests = [(1, rng.randint(1, 300)) for _ in range(24)] + [(5, 9)]
    step = make_step(requests, block_size=4, num_heads=6, num_kv_heads=2, head_dim=16,
                     dtype=torch.float32, seed=7)
    check_against_reference(TorchPagedBackend(use_kernel=False), *step)


@pytest.mark.parametrize("use_kernel", [False, True])
def test_plan_reused_across_layers_and_rebuilt_for_a_new_step(use_kernel):
    backend = TorchPagedBackend(use_kernel)
    shape = dict(block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    meta, cache, q, k, v = make_step([(1, 9), (6, 13), (1, 30)], seed=1, **shape)
    other_layer = make_step([(1, 9), (6, 13), (1, 30)], seed=2, **shape)[1]
    check_against_reference(backend, meta, cache, q, k, v)
    check_against_reference(backend, meta, other_layer, q, k, v)  # same step, next layer
    check_against_reference(backend, *make_step([(3, 3), (1, 50)], seed=4, **shape))  # next step


@pytest.mark.parametrize("use_kernel", [False, True])
def test_strided_views_and_custom_scale(use_kernel):
    # the model hands q/k/v as views of one fused projection output
    meta, cache, q, k, v = make_step([(1, 21), (7, 12)], block_size=4, num_heads=4, num_kv_heads=2,
                                     head_dim=16, dtype=torch.float32, seed=5)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q2, k2, v2 = (t.view(t.shape[0], -1, 16) for t in fused.split([64, 32, 32], dim=1))
    assert not q2.is_contiguous()
    check_against_reference(TorchPagedBackend(use_kernel), meta, cache, q2, k2, v2, scale=0.3)


def test_write_kv_converts_to_cache_dtype():
    meta, cache, q, k, v = make_step([(3, 7)], block_size=4, num_heads=2, num_kv_heads=2, head_dim=8,
                                     dtype=torch.float32, seed=6)
    cache = cache.to(torch.bfloat16)
    expected = cache.clone()
    ReferenceBackend().write_kv(k, v, expected, meta)
    TorchPagedBackend().write_kv(k, v, cache, meta)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_decodes_in_one_call_without_buckets(dtype):
    # 6 query heads over 2 kv heads: each kernel work item carries a group of 3
    meta, cache, q, k, v = make_step([(1, 40), (1, 3), (4, 9)], block_size=4, num_heads=6, num_kv_heads=2,
                                     head_dim=16, dtype=dtype, seed=8)
    backend = TorchPagedBackend(use_kernel=True)
    check_against_reference(backend, meta, cache, q, k, v)
    plan = backend._plan
    assert plan.decodes == [] and plan.kernel_decodes.token_idx.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.kernel_decodes.seq_lens.tolist() == [40, 3, 6, 7, 8, 9] and plan.prefills == []


def test_a_query_longer_than_verify_rows_stays_a_prefill():
    q_len = torch_paged.VERIFY_MAX_ROWS + 1
    meta, cache, q, k, v = make_step([(1, 40), (q_len, q_len + 5)], block_size=4, num_heads=6, num_kv_heads=2,
                                     head_dim=16, dtype=torch.float32, seed=8)
    backend = TorchPagedBackend(use_kernel=True)
    check_against_reference(backend, meta, cache, q, k, v)
    assert backend._plan.kernel_decodes.token_idx.tolist() == [0] and len(backend._plan.prefills) == 1


@pytest.fixture
def num_threads():
    """Sets torch's thread count for the test (the decode kernel splits by it), then restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_decodes_than_threads_are_sliced_and_merged_like_one_pass(num_threads, threads, dtype):
    # SmolLM2's shape. With fewer decodes than threads each one of at least 8 blocks is cut
    # into up to one slice per thread (4 blocks at least each), merged after: 127 tokens (8
    # blocks: 2 slices), 128, 300 (19 blocks: 3 slices of 6, 6, 7 on 3 threads), 1000; and 64
    # (4 blocks: whole)
    num_threads(threads)
    for seq_len in (64, 127, 128, 300, 1000):
        step = make_step([(1, seq_len)], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                         seed=seq_len)
        check_against_reference(TorchPagedBackend(use_kernel=True), *step)
    if threads == 3:  # two decodes on three threads: both sliced, beside a prefill
        step = make_step([(1, 300), (9, 9), (1, 140)], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                         dtype=dtype, seed=5)
        check_against_reference(TorchPagedBackend(use_kernel=True), *step)


def test_get_backend_by_name():
    for name in ("torch", "reference", "triton"):
        assert get_backend(name).name == name
    with pytest.raises(ValueError, match="torch, triton, reference"):
        get_backend("flash")


def test_cpu_kernels_load_at_the_first_cpu_step_not_before(monkeypatch):
    loaded = []
    load = torch_paged.cpu_extensions.load
    monkeypatch.setattr(torch_paged.cpu_extensions, "load", lambda name: loaded.append(name) or load(name))
    backend = TorchPagedBackend()
    assert loaded == []  # a CUDA worker's backend never gets further
    check_against_reference(backend, *make_step([(1, 40), (5, 9)], block_size=16, num_heads=4, num_kv_heads=2,
                                                head_dim=64, dtype=torch.bfloat16))
    assert loaded == ["decode", "prefill"]
    assert TorchPagedBackend(use_kernel=False)._kernel is None and loaded == ["decode", "prefill"]


def test_positions_from_query_and_seq_lens():
    meta = AttentionMetadata.build([1, 3, 2], [5, 3, 10], [[0, 1], [2], [3, 4, 5]], 4)
    assert AttentionMetadata.positions(meta).tolist() == [4, 0, 1, 2, 8, 9]
