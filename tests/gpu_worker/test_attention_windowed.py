"""Sliding-window and soft-capped paged attention (Gemma 2/3): TorchPagedBackend's windowed path
against the dense ReferenceBackend over random paged layouts; the reference's window against
transformers' own mask rule; keys wholly before every window are never read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.gpu_worker.attention.reference import ReferenceBackend
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend
from pagedserve.services.gpu_worker.attention.windowed import first_key
from tests.gpu_worker.test_attention import TOLERANCE, make_step

SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def _both(requests, window, softcap, dtype=torch.float32, block_size=4, seed=0, shared_blocks=0):
    meta, cache, q, k, v = make_step(requests, block_size=block_size, dtype=dtype, seed=seed,
                                     shared_blocks=shared_blocks, **SHAPE)
    ref = ReferenceBackend()
    ref.write_kv(k, v, cache, meta)
    scale = 0.3
    expected = ref.attend(q, cache, meta, scale, window=window, softcap=softcap)
    got = TorchPagedBackend().attend(q, cache, meta, scale, window=window, softcap=softcap)
    return got, expected, (meta, cache, q, scale)


@settings(max_examples=25, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 30)), min_size=1, max_size=5),
       window=st.one_of(st.none(), st.integers(1, 20)), softcap=st.sampled_from([None, 1.0, 50.0]),
       block_size=st.sampled_from([1, 4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_windowed_equals_the_reference(requests, window, softcap, block_size, dtype):
    requests = [(q, q + extra) for q, extra in requests]  # (query_len, seq_len)
    if window is None and softcap is None:
        window = 5
    got, expected, _ = _both(requests, window, softcap, dtype, block_size)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


def test_reference_window_is_transformers_sliding_window_rule():
    """Query at t sees key p iff p <= t and t - p < window (transformers' sliding_window_overlay)."""
    from transformers.masking_utils import sliding_window_overlay

    requests, window = [(9, 20)], 6
    meta, cache, q, k, v = make_step(requests, block_size=4, dtype=torch.float32, **SHAPE)
    ref = ReferenceBackend()
    ref.write_kv(k, v, cache, meta)
    got = ref.attend(q, cache, meta, 0.25, window=window)
    allowed = sliding_window_overlay(window)
    keys = cache[:, meta.block_tables[0].long()].reshape(2, -1, 2, 16)[:, :20].repeat_interleave(2, dim=2)
    for row, t in enumerate(range(11, 20)):
        visible = torch.tensor([p <= t and allowed(0, 0, t, p) for p in range(20)])
        scores = torch.einsum("hd,khd->hk", q[row], keys[0]) * 0.25
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        torch.testing.assert_close(got[row], torch.einsum("hk,khd->hd", probs, keys[1]))


def test_a_window_past_the_context_and_no_cap_equal_plain_causal_attention():
    meta, cache, q, k, v = make_step([(5, 12), (1, 9), (7, 7)], block_size=4, dtype=torch.float32, **SHAPE)
    ref = ReferenceBackend()
    ref.write_kv(k, v, cache, meta)
    plain = TorchPagedBackend().attend(q, cache, meta, 0.25)
    torch.testing.assert_close(TorchPagedBackend().attend(q, cache, meta, 0.25, window=12), plain)
    torch.testing.assert_close(ref.attend(q, cache, meta, 0.25, window=100), plain)


@pytest.mark.parametrize("requests", [[(1, 40)], [(6, 40)], [(1, 33), (3, 40), (1, 17)]])
def test_keys_before_every_window_are_never_read(requests):
    """NaN in every slot before a request's first window key leaves the output finite and unchanged."""
    window = 8
    got, expected, (meta, cache, q, scale) = _both(requests, window, 50.0)
    for i, (q_len, s_len) in enumerate(requests):
        first = first_key(s_len, q_len, window)
        assert first > 0
        for p in range(first):
            cache[:, int(meta.block_tables[i, p // 4]), p % 4] = float("nan")
    poisoned = TorchPagedBackend().attend(q, cache, meta, scale, window=window, softcap=50.0)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, expected, **TOLERANCE[torch.float32])
