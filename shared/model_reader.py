"""A model's config from its name or path, torch-free: what the api and the worker both read
(a GGUF's header, or an HF folder's config.json with every eos id the folder declares)."""

from __future__ import annotations

import functools
import json
import os

from pagedserve.shared.model_config import ModelConfig
from pagedserve.shared.model_source import find_gguf_in_dir, resolve_model

# the tensor types served (Q4_K_M/Q5_K_M files mix Q4_K/Q5_K with Q6_K); others are refused at start
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


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
    gguf_file = gguf_file_of(path)
    if gguf_file:
        reader = open_gguf(gguf_file)
        check_gguf_types(reader, gguf_file)
        return ModelConfig.from_gguf(reader)
    return hf_dir_config(path)


def gguf_file_of(path: str) -> str | None:
    return find_gguf_in_dir(path) if os.path.isdir(path) else path


def check_gguf_types(reader, path: str) -> None:
    """Refuse a GGUF holding a tensor type outside GGUF_TYPES, naming it and those served."""
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GGUF_TYPES:
            raise ValueError(f"{os.path.basename(path)}: tensor {tensor.name!r} has GGUF type "
                             f"{tensor.tensor_type.name}, not supported (supported: {', '.join(GGUF_TYPES)})")


def hf_dir_config(directory: str) -> ModelConfig:
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
