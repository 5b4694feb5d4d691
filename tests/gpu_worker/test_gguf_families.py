"""GGUF files as people download them: each family's tiny checkpoint written by the `gguf`
package in every type it can write loads with logits within 1e-4 of transformers holding the
same (dequantized) weights; random blocks of every served type dequantize through the loader
exactly as `gguf.quants.dequantize`; other types are refused at start, by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve.services.gpu_worker.kv_pool import KVPool
from pagedserve.services.gpu_worker.model.llama import build_model
from pagedserve.services.gpu_worker.model.weights import dequantize_tensor
from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_reader import GGUF_TYPES, load_config, open_gguf
from pagedserve.shared.tokenizer import load_tokenizer
from tests.gpu_worker.family_checkpoints import GGUF_FAMILIES, VOCAB, gguf_checkpoint, hf_checkpoint, save_servable
from tests.gpu_worker.family_gguf import K_QUANTS, random_blocks, write_gguf
from tests.gpu_worker.test_model import BLOCK_SIZE, BLOCK_TABLE, NUM_BLOCKS, run_step

WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0")  # the types gguf's Python quantizes
K_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # K-quant rows are 256-weight blocks


@pytest.mark.parametrize("type_name", WRITABLE)
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_logits_match_transformers_on_the_same_weights(tmp_path, name, type_name):
    hf_model = gguf_checkpoint(name)
    path = tmp_path / f"{name}-{type_name}.gguf"
    hf_model.load_state_dict(write_gguf(hf_model, path, type_name), strict=False)
    model = build_model(str(path))
    arch = "llama" if name in ("llama3", "mistral") else name
    assert model.config.architecture == {"gemma3": "gemma3_text"}.get(arch, arch)
    # Phi-3's context is longrope's original one, as from its folder
    context = "128 tokens \\(its phi3.rope.scaling.original_context_length" if name == "phi3" else \
        f"256 tokens \\(its {arch}.context_length"
    with pytest.raises(ValueError, match=f"context of {context}"):
        model.config.context_length(model.config.max_position_embeddings + 1)
    if name == "phi3":  # longrope's factors and attention factor, the rope on 3/4 of each head
        ours, theirs = model.config.rope_scaling, load_config_hf(hf_model).rope_scaling
        assert set(ours) >= {"short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"}
        for key, value in ours.items():  # the file holds float32
            assert value == (theirs[key] if isinstance(value, str) else pytest.approx(theirs[key], rel=1e-7)), key
        assert (model.config.head_dim, model.config.rotary_dim) == (16, 12)
    if name == "llama3":
        assert model.config.rope_scaling["rope_type"] == "freq_factors"  # from the file's rope_freqs
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    logits = model.compute_logits(run_step(model, KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches,
                                           [(prompt, 0, BLOCK_TABLE)]))
    assert (logits - expected).abs().max() < 1e-4


def _write_one_tensor(path, type_name: str, raw: np.ndarray) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("type_name", [t for t in GGUF_TYPES if t != "F32"])
def test_loader_dequantizes_random_blocks_as_gguf_does(tmp_path, type_name):
    raw = random_blocks(type_name, 8, 512)
    _write_one_tensor(tmp_path / "blocks.gguf", type_name, raw)
    (tensor,) = open_gguf(str(tmp_path / "blocks.gguf")).tensors
    loaded = dequantize_tensor(tensor)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert loaded.shape == (8, 512) and loaded.dtype == np.float32
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(loaded, expected)


def test_unsupported_quant_type_is_refused_at_start(tmp_path):
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    path = tmp_path / "iq.gguf"
    _write_one_tensor(path, "IQ4_NL", np.zeros((8, 512 // block * block_bytes), np.uint8))
    with pytest.raises(ValueError, match=r"iq.gguf: tensor 'blk.0.ffn_up.weight' has GGUF type IQ4_NL, "
                                         r"not supported \(supported: F32, F16, BF16, Q8_0"):
        load_config(str(path))
    with pytest.raises(ValueError, match="IQ4_NL"):
        build_model(str(path))


def load_config_hf(hf_model) -> ModelConfig:
    return ModelConfig.from_hf_config(hf_model.config.to_dict())


def test_unsupported_gguf_architecture_is_refused_naming_the_supported(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' not supported \(supported: llama, qwen2, qwen3, "
                                         r"phi3, gemma2, gemma3\)"):
        load_config(str(tmp_path / "falcon.gguf"))


def test_a_gguf_serves_its_own_tokenizer_template_and_eot(tmp_path, monkeypatch):
    """A Qwen3 GGUF with tokenizer.ggml.* (eos <|endoftext|>, eot <|im_end|>): the tokenizer and
    chat template transformers builds from it equal the folder's, and both ids stop a request."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf_model, hf_tokenizer = save_servable("qwen3", tmp_path / "folder")
    path = tmp_path / "gguf" / "qwen3.gguf"
    path.parent.mkdir()
    write_gguf(hf_model, path, "Q8_0", tokenizer=hf_tokenizer, eot_token_id=2)
    assert load_config(str(path)).eos_token_ids == [0, 2]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    expected = list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    text = "héllo wörld 🎉 Paris"
    for _ in ("cold", "cached"):
        load_tokenizer.cache_clear()
        tokenizer = load_tokenizer(str(path))
        assert tokenizer.apply_chat_template(messages) == expected
        assert tokenizer.encode(text) == hf_tokenizer.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("type_name", [*K_QUANTS, "Q4_K_M"])
def test_k_quant_gguf_logits_match_transformers_on_the_same_weights(tmp_path, type_name):
    """gguf cannot quantize K types: the file holds random K blocks, transformers their dequantized values."""
    hf_model = hf_checkpoint("llama3", **K_SHAPE)
    path = tmp_path / f"llama3-{type_name}.gguf"
    hf_model.load_state_dict(write_gguf(hf_model, path, type_name), strict=False)
    reader = open_gguf(str(path))
    mix = {"Q4_K", "Q6_K"} if type_name == "Q4_K_M" else {type_name}
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == mix
    model = build_model(str(path))
    prompt = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    logits = model.compute_logits(run_step(model, KVPool(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).kv_caches,
                                           [(prompt, 0, BLOCK_TABLE)]))
    # 1e-4 of the largest logit (up to ~40 here: random K blocks make wide weights)
    assert (logits - expected).abs().max() < 1e-4 * max(1.0, expected.abs().max().item())


def test_a_phi3_gguf_with_a_window_caps_the_context_as_its_folder(tmp_path):
    """Phi-3's converter writes sliding_window (0 where there is none); every layer slides, so the
    context is the window, as from the folder."""
    hf_model = hf_checkpoint("phi3", sliding_window=64)
    write_gguf(hf_model, tmp_path / "phi3.gguf")
    config = load_config(str(tmp_path / "phi3.gguf"))
    assert config.max_position_embeddings == load_config_hf(hf_model).max_position_embeddings == 64
    with pytest.raises(ValueError, match=r"context of 64 tokens \(its phi3.attention.sliding_window\)"):
        config.context_length(65)
    write_gguf(hf_checkpoint("phi3"), tmp_path / "none.gguf")  # window 0: longrope's original context
    assert load_config(str(tmp_path / "none.gguf")).max_position_embeddings == 128
