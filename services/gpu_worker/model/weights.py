"""Load an HF directory or GGUF file into one canonical float32 state dict (HF names;
`lm_head.weight` only when the embeddings are not tied). GGUF tensors of the types in
GGUF_TYPES are dequantized at load by the gguf package's own `gguf.quants.dequantize`."""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import torch

from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_families import FAMILIES, Family
from pagedserve.shared.model_reader import gguf_file_of, load_config, open_gguf
from pagedserve.shared.model_source import resolve_model

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's [q; k; v]
}
_GGUF_FUSED_NAMES = {"ffn_up": "mlp.gate_up_proj"}  # Phi-3's ffn_up holds [gate; up]
# Gemma's sandwich: ffn_norm is the norm before the MLP, not the one after attention
_GGUF_SANDWICH_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# read into the config (rope), not the state
_GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
def load_weights(path_or_name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A model name or path -> (config, float32 state dict with canonical names)."""
    path = resolve_model(path_or_name)
    config, gguf_file = load_config(path), gguf_file_of(path)
    return config, _gguf_state(gguf_file, config) if gguf_file else _hf_state(path, config)


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUFReader tensor -> float32 [rows, cols] (HF [out, in] order; 1-D stays 1-D), a copy."""
    import gguf

    return np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _hf_state(directory: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"{directory} has config.json but no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:  # sharded checkpoints: each shard holds a disjoint set of names
        for name, tensor in load_file(file).items():
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some exports include
                continue
            state[name] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _gguf_state(path: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    reader = open_gguf(path)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        name = _canonical_gguf_name(tensor.name, FAMILIES[config.architecture])
        values = dequantize_tensor(tensor)
        if config.norm_offset and name.endswith("norm.weight"):  # llama.cpp stores Gemma's as offset + w
            values -= np.float32(config.norm_offset)
        state[name] = torch.from_numpy(unpermute_if_rope_rows(name, values, config))
    return state


def unpermute_if_rope_rows(name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
    """HF row order for a Q or K projection (weight or bias) of an arch llama.cpp permutes."""
    if not FAMILIES[config.architecture].gguf_rope_rows_permuted:
        return rows
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rope_rows(rows, config.num_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rope_rows(rows, config.num_kv_heads)
    return rows


def _canonical_gguf_name(gguf_name: str, family: Family | None = None) -> str:
    """The HF name of a GGUF tensor of the family (None: names every family shares)."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    names = dict(_GGUF_LAYER_NAMES)
    if family is not None and family.fused_projections:
        names.update(_GGUF_FUSED_NAMES)
    if family is not None and family.gemma:
        names.update(_GGUF_SANDWICH_NAMES)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} (knows {', '.join(names)})")
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGUF head row 2*i + j is HF row j * D/2 + i."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weights.shape))
