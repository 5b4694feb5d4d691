"""The named workloads ship in the package: a wheel built from this tree, installed into a
folder of its own and run from a directory outside the repo, loads `random-64` and runs
`pagedserve bench serve --workload random-64` (against a port where nothing listens: every
request fails fast, and the report counts all 64 of them, so the workload was found)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.services.bench.named_workloads import random_mix

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """site-packages-like folder holding only the wheel's files."""
    root = tmp_path_factory.mktemp("installed")
    wheels, site = root / "wheels", root / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, cwd=root, timeout=300)
    [wheel] = wheels.glob("pagedserve-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, cwd=root, timeout=300)
    return site


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_named_workload_loads_from_an_installed_copy(installed, tmp_path):
    code = ("import json; import pagedserve.services as services; from pagedserve.services.bench.workloads import load_workload; "
            "w = load_workload('random-64'); "
            "print(json.dumps([services.__file__, len(w), [r.max_tokens for r in w], w[0].prompt_token_ids]))")
    proc = _run(installed, tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr
    where, count, max_tokens, first_prompt = json.loads(proc.stdout)
    assert Path(where).is_relative_to(installed)  # the installed copy, not this checkout
    expected = random_mix(64, 0, 64, 512, 32, 256)
    assert count == 64
    assert max_tokens == [item["max_tokens"] for item in expected]
    assert first_prompt == expected[0]["prompt_token_ids"]


@pytest.mark.slow
def test_bench_serve_takes_a_named_workload_from_an_installed_copy(installed, tmp_path):
    out = tmp_path / "report.json"
    proc = _run(installed, tmp_path, "-m", "pagedserve.services.cli", "bench", "serve", "--url",
                f"http://127.0.0.1:{_closed_port()}", "--workload", "random-64", "--output", str(out))
    assert out.exists(), proc.stdout + proc.stderr  # exit status 1: every request failed
    [row] = json.loads(out.read_text())
    assert row["num_failed"] == 64
