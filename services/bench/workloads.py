"""Benchmark workloads: the named ones (named_workloads.py, every figure is quoted on one) or a JSON file
of [{"prompt_token_ids": [...], "max_tokens": N, optionally "ignore_eos": false}, ...]."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagedserve.services.bench.named_workloads import WORKLOADS


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True


def load_workload(name_or_file: str) -> list[BenchRequest]:
    if os.path.isfile(name_or_file):
        with open(name_or_file) as f:
            items = json.load(f)
    else:
        if name_or_file not in WORKLOADS:
            raise ValueError(f"unknown workload {name_or_file!r}; known: {', '.join(WORKLOADS)} or a JSON file")
        items = WORKLOADS[name_or_file]()
    try:
        return [BenchRequest(list(map(int, it["prompt_token_ids"])), int(it["max_tokens"]), bool(it.get("ignore_eos", True)))
                for it in items]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"workload {name_or_file!r}: each item needs prompt_token_ids and max_tokens ({e})") from e
