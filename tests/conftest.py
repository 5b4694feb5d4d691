"""Fixtures shared across the suite: the real default model's tokenizer and the HF
transformers reference (float32, the same GGUF weights), each loaded once per session."""

from __future__ import annotations

import os

import pytest
import tqdm.std

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No tqdm monitor thread: an in-process bench's progress bar would start one that outlives its
# test, waking every 10 s in this process through every later module
tqdm.std.tqdm.monitor_interval = 0

# Modules whose tests run one after another, on one worker, even under pytest-xdist: the fault
# tests time outages and restarts, and share the machine's network namespaces.
SERIAL_GROUPS = {"tests/faults/": "faults"}
# Session fixtures that start processes or load the model: the modules using one share a group,
# so under pytest-xdist each starts once, on one worker, not once per worker.
SHARED_SESSION_FIXTURES = ("backend", "engine_f32", "hf_model", "two_workers")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns the groups into node id suffixes
def pytest_collection_modifyitems(config, items):
    """Under `pytest -n N --dist loadgroup --no-loadscope-reorder` each module is one group (its
    module fixtures start once, on one worker), modules sharing an expensive session fixture are
    one group, and the serial groups go first, then the shared ones, then the slow: longest first."""
    groups = _groups(items)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(name=groups[_module(item)]))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its collection order is the schedule's
        serial = set(SERIAL_GROUPS.values())
        items.sort(key=lambda item: 0 if _group(item) in serial else 1 if "+" in _group(item)
                   else 2 if item.get_closest_marker("slow") else 3)


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def _groups(items) -> dict[str, str]:
    """Module path -> its xdist group: its serial group, else the modules and session fixtures
    it is connected to (union-find; such a group is named by its fixtures, joined by "+")."""
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent.setdefault(node, node) != node:
            node = parent[node]
        return node

    for item in items:
        module = _module(item)
        root(module)
        for name in _session_fixtures(item):
            parent[root(f"fixture:{name}")] = root(module)
    members: dict[str, set[str]] = {}
    for node in list(parent):
        members.setdefault(root(node), set()).add(node)
    groups = {}
    for nodes in members.values():
        modules = sorted(n for n in nodes if not n.startswith("fixture:"))
        fixtures = sorted(n[len("fixture:"):] for n in nodes if n.startswith("fixture:"))
        serial = [name for prefix, name in SERIAL_GROUPS.items() if any(m.startswith(prefix) for m in modules)]
        name = serial[0] if serial else "+".join(["session", *fixtures]) if fixtures else modules[0]
        groups.update(dict.fromkeys(modules, name))
    return groups


def _session_fixtures(item) -> list[str]:
    """The SHARED_SESSION_FIXTURES item uses (through other fixtures too), as defined in a conftest:
    a module's own fixture of the same name is not one."""
    defs = getattr(item, "_fixtureinfo", None)
    defs = defs.name2fixturedefs if defs is not None else {}
    return [name for name in SHARED_SESSION_FIXTURES if name in getattr(item, "fixturenames", ())
            and defs.get(name) and defs[name][-1].scope == "session"]


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
