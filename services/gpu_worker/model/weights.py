"""Load an HF directory or GGUF file into one canonical float32 state dict (HF names;
`lm_head.weight` only when the embeddings are not tied). GGUF tensors of the types in
GGUF_TYPES are dequantized at load by the gguf package's own `gguf.quants.dequantize`."""

from __future__ import annotations

import functools
import glob
import json
import os
import re

import numpy as np
import torch

from pagedserve.services.gpu_worker.model.config import ModelConfig
from pagedserve.services.gpu_worker.model.families import FAMILIES
from pagedserve.shared.model_source import find_gguf_in_dir, resolve_model

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
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_CONFIG_TENSORS = ("rope_freqs.weight",)  # read into the config (rope), not the state
# the tensor types served (Q4_K_M/Q5_K_M files mix Q4_K/Q5_K with Q6_K); others are refused at start
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def load_weights(path_or_name: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A model name or path -> (config, float32 state dict with canonical names)."""
    path = resolve_model(path_or_name)
    if os.path.isdir(path):
        gguf_file = find_gguf_in_dir(path)
        return _load_gguf(gguf_file) if gguf_file else _load_hf_dir(path)
    return _load_gguf(path)


@functools.lru_cache(maxsize=4)
def gguf_reader(path: str, mtime_ns: int | None = None):
    """A cached GGUFReader per (file, mtime_ns): headers parse slowly; tensor data are memory maps."""
    import gguf

    return gguf.GGUFReader(path)


def open_gguf(path: str):
    return gguf_reader(path, os.stat(path).st_mtime_ns)


def load_config(path_or_name: str) -> ModelConfig:
    """Only the config (reads headers, no tensor data)."""
    path = resolve_model(path_or_name)
    gguf_file = find_gguf_in_dir(path) if os.path.isdir(path) else path
    if gguf_file:
        reader = open_gguf(gguf_file)
        check_gguf_types(reader, gguf_file)
        return ModelConfig.from_gguf(reader)
    return _hf_dir_config(path)


def check_gguf_types(reader, path: str) -> None:
    """Refuse a GGUF holding a tensor type outside GGUF_TYPES, naming it and those served."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGUF_TYPES:
            raise ValueError(f"{os.path.basename(path)}: tensor {tensor.name!r} has GGUF type "
                             f"{tensor.tensor_type.name}, not supported (supported: {', '.join(GGUF_TYPES)})")


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUFReader tensor -> float32 [rows, cols] (HF [out, in] order; 1-D stays 1-D), a copy."""
    import gguf

    return np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _hf_dir_config(directory: str) -> ModelConfig:
    """config.json, with every eos id the folder declares: config.json's, generation_config.json's
    and tokenizer_config.json's eos_token (Qwen2.5's <|im_end|>, Llama 3's <|eot_id|>)."""
    config = _json(directory, "config.json")
    model_config = ModelConfig.from_hf_config(config, _json(directory, "generation_config.json"))
    eos = _tokenizer_eos_id(directory)
    if eos is not None and eos not in model_config.eos_token_ids:
        model_config.eos_token_ids.append(eos)
    return model_config


def _json(directory: str, name: str) -> dict | None:
    path = os.path.join(directory, name)
    if name != "config.json" and not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _tokenizer_eos_id(directory: str) -> int | None:
    """tokenizer_config.json's eos_token as an id of tokenizer.json; None where either lacks it."""
    tokenizer_config = _json(directory, "tokenizer_config.json") or {}
    eos = tokenizer_config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not eos or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None
    tokenizer = _json(directory, "tokenizer.json")
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    token_id = tokenizer.get("model", {}).get("vocab", {}).get(eos)
    return None if token_id is None else int(token_id)


def _load_hf_dir(directory: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = _hf_dir_config(directory)
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
    return config, state


def _load_gguf(path: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    check_gguf_types(reader, path)
    config = ModelConfig.from_gguf(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        name = _canonical_gguf_name(tensor.name)
        state[name] = torch.from_numpy(unpermute_if_rope_rows(name, dequantize_tensor(tensor), config))
    return config, state


def unpermute_if_rope_rows(name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
    """HF row order for a Q or K projection (weight or bias) of an arch llama.cpp permutes."""
    if not FAMILIES[config.architecture].gguf_rope_rows_permuted:
        return rows
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rope_rows(rows, config.num_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rope_rows(rows, config.num_kv_heads)
    return rows


def _canonical_gguf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r} (knows {', '.join(_GGUF_LAYER_NAMES)})")
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGUF head row 2*i + j is HF row j * D/2 + i."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weights.shape))
