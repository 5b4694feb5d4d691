"""TritonPagedBackend against the dense ReferenceBackend.

On CPU the kernels run under the Triton interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported: triton.jit reads it when it decorates,
its own library functions included. Another test module of the same pytest process may
already have imported triton, so the interpreter cases run in one child python started with
the variable set (one start for all cases); each case then reports as its own test. Where
CUDA is present the same cases also run natively, in this process.
Cases are small: the interpreter runs each program instance in Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from tests.gpu_worker.test_attention import TOLERANCE, check_against_reference, make_step

REPO_ROOT = Path(__file__).resolve().parents[2]
ROWS_PER_TILE = 64  # triton_paged.ROWS_PER_TILE, not imported here so that triton is not


def _backend():
    from pagedserve.services.gpu_worker.attention.triton_paged import TritonPagedBackend

    return TritonPagedBackend()


def mixed_batch_block_size_4_with_shared_prefix(device):
    # decodes ending mid-block and at a block edge, a one-token context, a fresh prefill and a
    # chunk after cached context; requests 0 and 1 share their first two blocks
    requests = [(1, 11), (3, 12), (1, 8), (1, 1), (5, 5), (6, 15)]
    for dtype in (torch.float32, torch.bfloat16):
        check_against_reference(_backend(), *make_step(
            requests, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype,
            shared_blocks=2, seed=11, device=device))


def real_model_grouping_block_size_16(device):
    # 9 query heads over 3 kv heads (the real model's grouping, a group that is no power of
    # two), contexts longer than one key step, a chunk spanning two query tiles
    tokens_per_tile = ROWS_PER_TILE // 3
    requests = [(1, 45), (tokens_per_tile + 3, tokens_per_tile + 20), (1, 16)]
    check_against_reference(_backend(), *make_step(
        requests, block_size=16, num_heads=9, num_kv_heads=3, head_dim=32, dtype=torch.bfloat16,
        seed=12, device=device))


def pure_decodes_multi_head(device):
    requests = [(1, 1), (1, 17), (1, 33), (1, 64)]
    check_against_reference(_backend(), *make_step(
        requests, block_size=16, num_heads=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
        seed=13, device=device))


def one_kv_head_and_head_dim_not_a_power_of_two(device):
    requests = [(1, 10), (4, 13), (3, 3)]
    check_against_reference(_backend(), *make_step(
        requests, block_size=8, num_heads=4, num_kv_heads=1, head_dim=24, dtype=torch.float32,
        seed=15, device=device))


def write_kv_only_touches_the_new_slots(device):
    meta, cache, _q, k, v = make_step([(2, 6), (1, 3)], block_size=4, num_heads=2, num_kv_heads=2,
                                      head_dim=8, dtype=torch.float32, seed=14, device=device)
    before = cache.clone()
    _backend().write_kv(k, v, cache, meta)
    flat_before, flat = before.view(2, -1, 2, 8), cache.view(2, -1, 2, 8)
    written = torch.zeros(flat.shape[1], dtype=torch.bool, device=flat.device)
    written[meta.slot_mapping] = True
    assert torch.equal(flat[:, ~written], flat_before[:, ~written])
    assert torch.equal(flat[0, meta.slot_mapping], k) and torch.equal(flat[1, meta.slot_mapping], v)


def int8_pool_quantizes_on_write_and_dequantizes_in_the_kernel(device):
    # the int8 pool (kv_quant.py): write_kv stores quantize(k), quantize(v) bit for bit, attend
    # matches the reference reading the same rows; decodes, a chunk, a prefill, a shared prefix
    from tests.gpu_worker.test_kv_quant import check_int8_against_reference, int8_step

    for dtype, heads, kv_heads, head_dim in ((torch.float32, 4, 2, 16), (torch.bfloat16, 9, 3, 32)):
        check_int8_against_reference(_backend(), *int8_step(
            requests=[(1, 11), (3, 12), (1, 8), (1, 1), (5, 5), (6, 15)], block_size=4, num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, shared_blocks=2, seed=16, device=device))


def _windowed(requests, window, softcap, dtype, device, nan_before_windows=False, **shape):
    """The backend's attend (window, softcap) on a make_step layout against the reference's on the
    same data; nan_before_windows: NaN first fills every slot (of the backend's pool) before a
    request's first window key."""
    from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend
    from pagedserve.services.gpu_worker.attention.windowed import first_key

    def attend(backend, on, plant):
        meta, cache, q, k, v = make_step(requests, dtype=dtype, seed=17, device=on, **shape)
        backend.write_kv(k, v, cache, meta)
        block_size = cache.shape[2]
        for i, (q_len, s_len) in enumerate(requests if plant else []):
            for p in range(first_key(s_len, q_len, window)):
                cache[:, int(meta.block_tables[i, p // block_size]), p % block_size] = float("nan")
        return backend.attend(q, cache, meta, 0.3, window=window, softcap=softcap).cpu().float()

    got, expected = attend(_backend(), device, nan_before_windows), attend(ReferenceBackend(), "cpu", False)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def sliding_window_and_soft_cap_mixed_batch(device):
    # decodes and chunks whose windows start mid-block, past a first key step, and window 1;
    # a 70-token chunk (one kv head per group: 64-token tiles) whose last rows see no key in
    # the tile's first step
    requests = [(1, 11), (3, 12), (1, 40), (70, 80), (5, 5)]
    for window, softcap in ((5, 5.0), (1, None), (16, None), (None, 2.0), (100, 50.0)):
        for dtype in (torch.float32, torch.bfloat16):
            _windowed(requests, window, softcap, dtype, device, block_size=4, num_heads=2, num_kv_heads=2,
                      head_dim=16)


def sliding_window_grouped_never_reads_keys_before_it(device):
    requests = [(1, 45), (20, 60), (1, 17)]
    _windowed(requests, 8, 50.0, torch.float32, device, nan_before_windows=True, block_size=16,
              num_heads=9, num_kv_heads=3, head_dim=24)


CASES = {f.__name__: f for f in (mixed_batch_block_size_4_with_shared_prefix,
                                 real_model_grouping_block_size_16, pure_decodes_multi_head,
                                 one_kv_head_and_head_dim_not_a_power_of_two,
                                 write_kv_only_touches_the_new_slots,
                                 int8_pool_quantizes_on_write_and_dequantizes_in_the_kernel,
                                 sliding_window_and_soft_cap_mixed_batch,
                                 sliding_window_grouped_never_reads_keys_before_it)}


def run_cases_in_interpreter() -> None:
    """Child entry point: run every case on CPU tensors, print {case: traceback or null}."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for name, case in CASES.items():
        try:
            case("cpu")
            results[name] = None
        except Exception:  # reported per case by the parent
            results[name] = traceback.format_exc()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    child = subprocess.run(
        [sys.executable, "-c",
         "from tests.gpu_worker.test_attention_triton import run_cases_in_interpreter as run; run()"],
        cwd=REPO_ROOT, env={**os.environ, "TRITON_INTERPRET": "1",
             "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] is None, interpreter_results[case]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device and compiled (not interpreted) kernels")
@pytest.mark.parametrize("case", CASES)
def test_on_gpu(case):
    CASES[case]("cuda")


def test_cpu_tensors_refused_without_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process interprets kernels")
    meta, cache, q, _k, _v = make_step([(1, 3)], block_size=4, num_heads=2, num_kv_heads=2,
                                       head_dim=8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _backend().attend(q, cache, meta, 1.0)
