"""Fixtures shared across the suite: the real default model's tokenizer and the HF
transformers reference (float32, the same GGUF weights), each loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    from pagedserve.shared.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers' own Llama, loaded from the same GGUF, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.shared.model_source import resolve_model

    path = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def engine_f32():
    """The in-process engine in float32 (256 blocks), the reference the stack's outputs are
    compared with; built once, as loading the model is most of its cost."""
    from pagedserve.services.engine import Engine
    from pagedserve.shared.config import EngineConfig

    return Engine(EngineConfig(dtype="float32", num_blocks=256))
