"""`pagedserve generate`: one prompt answered from the terminal by the in-process engine."""

from __future__ import annotations

import subprocess

import pytest

from tests.cli.helpers import REPO, base_env, pagedserve_argv


@pytest.mark.slow
def test_generate_answers_a_chat_prompt():
    out = subprocess.run([*pagedserve_argv(), "generate", "What is the capital of France?", "--dtype", "float32",
                          "--max-tokens", "16"], cwd=REPO, env=base_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout, (out.stdout, out.stderr[-3000:])
