"""A model folder's generation_config.json sampling defaults, applied as vLLM applies them
(`--generation-config auto`, its default): a field a request omits takes the model's value.

Like vLLM (`GenerationConfig.to_diff_dict`), only values that differ from transformers' own
defaults count, so a file repeating `top_k: 50` changes nothing. A GGUF has none."""

from __future__ import annotations

import json
import os

# generation_config.json key -> (the request field it defaults, transformers' default)
_KEYS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def generation_defaults(path: str) -> dict[str, float | int]:
    """{field: value} from <path>/generation_config.json (max_new_tokens as max_tokens); {} for a
    GGUF or a folder without one."""
    file = os.path.join(path, "generation_config.json") if os.path.isdir(path) else None
    if file is None or not os.path.isfile(file):
        return {}
    with open(file) as f:
        config = json.load(f)
    defaults = {key: config[key] for key, default in _KEYS.items()
                if config.get(key) is not None and config[key] != default}
    if config.get("max_new_tokens") is not None:  # transformers' default is none: the request's max_tokens
        defaults["max_tokens"] = int(config["max_new_tokens"])
    return defaults
