"""Benchmark workloads: the project's named ones (../shared/bench/workload.py beside the
repo, the file every figure is quoted on) or a JSON file of
[{"prompt_token_ids": [...], "max_tokens": N}, ...]."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def _workload_module():
    candidates = [os.environ.get("PAGEDSERVE_WORKLOAD_PY", "")]
    repo = Path(__file__).resolve().parents[2]
    candidates += [str(repo.parent / "shared" / "bench" / "workload.py"), str(Path.cwd().parent / "shared/bench/workload.py")]
    for path in candidates:
        if path and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("pagedserve_bench_workload", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    return None


def load_workload(name_or_file: str) -> list[BenchRequest]:
    if os.path.isfile(name_or_file):
        with open(name_or_file) as f:
            items = json.load(f)
    else:
        module = _workload_module()
        if module is None:
            raise ValueError(f"workload {name_or_file!r}: no such file, and ../shared/bench/workload.py was not found "
                             "(set PAGEDSERVE_WORKLOAD_PY or pass a JSON file)")
        if name_or_file not in module.WORKLOADS:
            raise ValueError(f"unknown workload {name_or_file!r}; known: {', '.join(module.WORKLOADS)} or a JSON file")
        items = module.WORKLOADS[name_or_file]()
    try:
        return [BenchRequest(list(map(int, it["prompt_token_ids"])), int(it["max_tokens"])) for it in items]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"workload {name_or_file!r}: each item needs prompt_token_ids and max_tokens ({e})") from e
