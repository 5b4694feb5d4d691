"""Helpers for the `pagedserve` command's tests: how to invoke it, free ports, polling with
a deadline, and one real chat completion through a running api."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import httpx

from pagedserve.services.launcher.embedded_redis import free_port  # noqa: F401  (re-exported to the tests)
from tests.waiting import wait_for  # noqa: F401  (re-exported to the tests)

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 240.0


def pagedserve_argv() -> list[str]:
    """The installed console script if on PATH, else the module."""
    script = shutil.which("pagedserve")
    return [script] if script else [sys.executable, "-m", "pagedserve.services.cli"]


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return env


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def ready(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def chat_once(base_url: str, content: str = "What is the capital of France?") -> str:
    """One non-streaming chat completion (greedy, 16 tokens); asserts a sane reply, returns its text."""
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120.0, json={
        "model": "smollm2", "messages": [{"role": "user", "content": content}],
        "temperature": 0, "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert text.strip(), body
    return text
