"""Fixtures shared across the suite: the real default model's tokenizer and the HF
transformers reference (float32, the same GGUF weights), each loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Modules whose tests run one after another, on one worker, even under pytest-xdist: the fault
# tests time outages and restarts, and share the machine's network namespaces.
SERIAL_GROUPS = {"tests/faults/": "faults"}


def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup` each module is one group (its module fixtures start
    once, on one worker), and the serial groups go first: they are the longest chain."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::")[0]
            group = next((name for prefix, name in SERIAL_GROUPS.items() if path.startswith(prefix)), path)
            item.add_marker(pytest.mark.xdist_group(name=group))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its collection order is the schedule's
        serial = set(SERIAL_GROUPS.values())
        items.sort(key=lambda item: _group(item) not in serial)


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark.args else mark.kwargs.get("name", "default")


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
