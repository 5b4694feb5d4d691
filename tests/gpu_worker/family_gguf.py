"""A tiny transformers checkpoint written as a GGUF by the `gguf` package, the way llama.cpp's
convert_hf_to_gguf.py lays it out (Q/K rows interleaved for arch llama, llama3 rope as a
rope_freqs tensor, 1-D tensors kept F32), and the HF state the file really holds."""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import torch

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
         "gemma2": "gemma2", "gemma3_text": "gemma3"}
# Gemma's sandwich norms (llama.cpp's tensor_mapping.py); its ffn_norm is the one before the MLP
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_LAYER = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


# byte offsets of each block's fp16 scales (ggml-common.h): set finite, the rest stays random
_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """Random raw tensor data of the type, uint8 [rows, bytes per row], every fp16 scale finite, below scale."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("F16", "BF16"):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(values, qtype).view(np.uint8)
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    for offset in _FP16_FIELDS[type_name]:
        scales = (rng.random((rows, cols // block)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # gguf's Python dequantizes these, cannot quantize
# the largest fp16 scale of each K type's random blocks that a model uses: weights within about +-0.6
_K_SCALES = {"Q2_K": 0.01, "Q3_K": 0.005, "Q4_K": 0.0005, "Q5_K": 0.0003, "Q6_K": 0.0001}


def _tensor_type(type_name: str, hf_name: str) -> str:
    """Q4_K_M mixes as llama.cpp's does, in short: Q6_K for the output, attn_v and ffn_down, else Q4_K."""
    if type_name != "Q4_K_M":
        return type_name
    return "Q6_K" if hf_name.endswith(("lm_head.weight", "v_proj.weight", "down_proj.weight")) else "Q4_K"


def _gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**_LAYER, **_GEMMA_LAYER} if arch.startswith("gemma") else _LAYER
    return f"blk.{layer}.{names[module]}.{kind}"


def _write_gemma_header(writer, cfg, arch: str) -> None:
    """What convert_hf_to_gguf.py's Gemma2Model / Gemma3Model add: the caps, the window (Gemma 3:
    where a layer slides), Gemma 3's full layers' rope; no query_pre_attn_scalar, no local rope base."""
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
        return
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base(rope["rope_theta"])
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if "sliding_attention" in cfg.layer_types:
        writer.add_sliding_window(cfg.sliding_window)


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotate-half rows -> GGUF interleaved pairs, per head."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _rope_freqs(cfg, head_dim: int) -> np.ndarray:
    """llama.cpp's llama3 rope factors per dim pair (convert_hf_to_gguf.py's generate_extra_tensors)."""
    rope = cfg.rope_parameters
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_tokenizer(writer, tokenizer, eot_token_id: int | None) -> None:
    """tokenizer.ggml.* as llama.cpp writes a byte-level BPE (model gpt2): tokens, types, merges."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    added = {a["id"]: a["content"] for a in spec["added_tokens"]}
    tokens = {**{i: t for t, i in spec["model"]["vocab"].items()}, **added}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([tokens[i] for i in range(len(tokens))])
    writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_chat_template(tokenizer.chat_template)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)


def _write_rope(writer, cfg, head_dim: int) -> None:
    """Rope as the llama/qwen/phi3 converters write it: base, dims, llama3 factors, longrope's."""
    rope = cfg.rope_parameters
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":  # as convert_hf_to_gguf.py's Phi3MiniModel
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _rope_freqs(cfg, head_dim))


def write_gguf(hf_model, path, type_name: str = "F32", tokenizer=None, eot_token_id: int | None = None
               ) -> dict[str, torch.Tensor]:
    """Write the GGUF (2-D weights as type_name; a transformers fast tokenizer's vocabulary and
    chat template if given); returns the HF-named float32 state it holds."""
    cfg = hf_model.config
    arch = _ARCH[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if arch != "phi3":  # llama.cpp's Phi-3 converter writes no key_length: head_dim is hidden / heads
        writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch.startswith("gemma"):
        _write_gemma_header(writer, cfg, arch)
    else:
        _write_rope(writer, cfg, head_dim)
    if arch == "phi3":  # 0 where config.json has none
        writer.add_sliding_window(cfg.sliding_window or 0)
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    writer.add_eos_token_id(eos[0])
    if tokenizer is not None:
        _write_tokenizer(writer, tokenizer, eot_token_id)
    held = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # the converter adds Gemma's 1
            data = data + np.float32(1.0)
        qtype = gguf.GGMLQuantizationType[_tensor_type(type_name, name)]
        if data.ndim == 2 and qtype.name in K_QUANTS:  # random blocks stand in for the checkpoint's values
            data = random_blocks(qtype.name, *data.shape, seed=len(held), scale=_K_SCALES[qtype.name])
            held[name] = torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        elif data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, qtype)
            held[name] = torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        else:  # what the loader reads back: Gemma's norms less their 1
            held[name] = torch.from_numpy(data - np.float32(1.0) if arch.startswith("gemma") and name.endswith(
                "norm.weight") else data.copy())
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = _permute(data, heads)  # whole rows move: the blocks along each row stay intact
        raw_dtype = None if data.dtype in (np.float32, np.float16) else qtype
        writer.add_tensor(_gguf_name(name, arch), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
