"""The accuracy bench's simulated error sources: its round trip in groups of 32 with 12-bit scales is
exactly the int8 pool's, so each source it varies is measured against the real format."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.services.bench.kv_cache_accuracy import SOURCES, FakeQuantBackend, float32_logits, groups_of, round_trip
from pagedserve.services.gpu_worker.attention import kv_quant


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 40])
def test_groups_of_32_round_trip_is_the_pools(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = (torch.randn(5, 3, head_dim, generator=gen) * 10 ** (3 * torch.rand(head_dim, generator=gen) - 2)).bfloat16()
    assert torch.equal(groups_of(32)(x), kv_quant.dequantize(kv_quant.quantize(x)))


def test_exact_scales_round_each_value_to_its_groups_step():
    x = torch.tensor([[127.0, -63.5, 1.0, 0.25] * 4 + [2.0] * 16])
    expected = torch.tensor([[127.0, -64.0, 1.0, 0.0] * 4 + [2.0] * 16])  # steps 1 and 2 / 127; -63.5 to even
    assert torch.equal(round_trip(x, 16, exact_scales=True), expected)
    assert torch.equal(round_trip(x, 32, exact_scales=True), expected)
    assert torch.equal(round_trip(x, 32)[0, :16], expected[0, :16])  # a step of 1 has 12 bits


def test_every_source_names_its_k_and_v_round_trips():
    assert SOURCES["sim-unquantized-float32"] == (None, None, True)
    assert SOURCES["sim-int8-k-only"][1] is None and SOURCES["sim-int8-v-only"][0] is None


class RecordingBackend:
    name = "recording"

    def attend(self, query, kv_cache, meta, scale, **options):
        self.call = (query.dtype, kv_cache.dtype, options)
        return query


def test_fake_quant_backend_passes_the_layers_attention_options():
    inner = RecordingBackend()
    backend = FakeQuantBackend(inner, None, None)
    query, wide_pool = torch.zeros(2, 3, 4, dtype=torch.bfloat16), torch.zeros(2, 1, 4, 1, 4)
    backend.attend(query, wide_pool, None, 0.5, window=7, softcap=30.0)
    assert inner.call == (torch.bfloat16, torch.bfloat16, {"window": 7, "softcap": 30.0})


def test_float32_logits_are_the_unrounded_head_product():
    weight = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.25]], dtype=torch.bfloat16)
    model = SimpleNamespace(head=SimpleNamespace(weight=weight), config=SimpleNamespace(final_softcap=None))
    hidden = torch.tensor([[1.0, 1.0 / 3.0]], dtype=torch.bfloat16)
    logits = float32_logits(SimpleNamespace(model=model), hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, hidden.float() @ weight.float().T)
    model.config.final_softcap = 2.0
    assert torch.allclose(float32_logits(SimpleNamespace(model=model), hidden), torch.tanh(logits / 2.0) * 2.0)
