"""Gemma 2/3 GGUF headers as llama.cpp's convert_hf_to_gguf.py writes them and llama.cpp reads
them: a tiny checkpoint's file reads as its folder does; keys the converter leaves out take
llama.cpp's defaults (caps, window, 27B attention scale)."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_reader import load_config
from tests.gpu_worker.family_checkpoints import gguf_checkpoint
from tests.gpu_worker.family_gguf import write_gguf


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_gguf_reads_as_its_folder(tmp_path, name):
    hf_model = gguf_checkpoint(name)
    write_gguf(hf_model, tmp_path / "m.gguf")
    ours = load_config(str(tmp_path / "m.gguf"))
    theirs = ModelConfig.from_hf_config(hf_model.config.to_dict())
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-7)  # the header holds float32
    assert dataclasses.replace(ours, rms_norm_eps=theirs.rms_norm_eps) == theirs
    if name == "gemma3":
        assert ours.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert (ours.rope_theta, ours.rope_local_theta, ours.rope_scaling) == (
            1e6, 1e4, {"rope_type": "linear", "factor": 2.0})
    else:
        assert (ours.attn_softcap, ours.final_softcap, ours.sliding_window) == (5.0, 10.0, 8)


def _header(path, arch: str, layers: int, **keys) -> None:
    """A tensorless GGUF with the keys every family needs, hidden 512 over 8 heads of 128."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(8192)
    writer.add_embedding_length(512)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(1024)
    writer.add_head_count(8)
    writer.add_head_count_kv(4)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(256)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma2_header_without_caps_or_window_takes_llama_cpps_defaults(tmp_path):
    _header(tmp_path / "g2.gguf", "gemma2", 26)
    config = load_config(str(tmp_path / "g2.gguf"))
    assert (config.attn_softcap, config.final_softcap, config.sliding_window) == (50.0, 30.0, 4096)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 13
    assert (config.query_pre_attn_scalar, config.hidden_act, config.norm_offset) == (128.0, "gelu_pytorch_tanh", 1.0)
    assert config.max_position_embeddings == 8192  # Gemma's window is masked, the context not capped


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_the_27b_models_scale_attention_by_hidden_over_heads(tmp_path, arch, layers):
    _header(tmp_path / "27b.gguf", arch, layers, sliding_window=4096)
    assert load_config(str(tmp_path / "27b.gguf")).query_pre_attn_scalar == 512 / 8


def test_gemma3_header_without_a_window_slides_no_layer(tmp_path):
    _header(tmp_path / "full.gguf", "gemma3", 6, final_logit_softcapping=30.0)
    config = load_config(str(tmp_path / "full.gguf"))
    assert config.layer_types is None and [config.window(i) for i in range(6)] == [None] * 6
    assert (config.final_softcap, config.attn_softcap, config.rope_local_theta) == (30.0, None, 10000.0)


def test_gemma3_header_with_a_window_slides_five_layers_in_six(tmp_path):
    _header(tmp_path / "swa.gguf", "gemma3", 12, sliding_window=512)
    config = load_config(str(tmp_path / "swa.gguf"))
    assert [config.window(i) for i in range(12)] == ([512] * 5 + [None]) * 2
    assert config.final_softcap is None and config.query_pre_attn_scalar == 128.0
