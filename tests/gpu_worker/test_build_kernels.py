"""`pagedserve build-kernels`: builds into the cache named by TORCH_EXTENSIONS_DIR, saying
what it builds (and the first-start warning a worker would log), then finds it cached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNEL = "head_argmax"  # the quickest to compile


def _build(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PAGEDSERVE_CPU_KERNELS": "1"}
    return subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "build-kernels", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_build_then_cached(tmp_path):
    first = _build(tmp_path, "--only", KERNEL)
    assert first.returncode == 0, first.stdout + first.stderr
    lines = first.stdout.splitlines()
    assert lines[0] == f"CPU kernels: cache {tmp_path} (TORCH_EXTENSIONS_DIR moves it)"
    assert lines[1] == f"  {KERNEL} building cpu_{KERNEL}.cpp ..."
    assert lines[2].startswith(f"  {KERNEL} built in ")
    assert "building CPU kernels (first start" in first.stderr
    assert list(tmp_path.rglob(f"pagedserve_cpu_{KERNEL}*.so")) and list(tmp_path.rglob("pagedserve.stamp"))
    for obj in tmp_path.rglob("*.o"):  # ninja would rebuild it: a cached kernel loads its .so alone
        obj.unlink()
    second = _build(tmp_path, "--only", KERNEL)
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout.splitlines()[1:] == [f"  {KERNEL} cached"]
    assert "building CPU kernels" not in second.stderr
    assert not list(tmp_path.rglob("*.o"))


def test_kernels_off_builds_nothing(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PAGEDSERVE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "build-kernels"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "CPU kernels are off (PAGEDSERVE_CPU_KERNELS=0): nothing to build\n"
    assert list(tmp_path.iterdir()) == []


def test_a_stamp_from_another_build_is_not_cached(tmp_path, monkeypatch):
    from pagedserve.services.gpu_worker.kernels import cpu_extensions

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not cpu_extensions.is_built("fused")
    stamp = cpu_extensions.build_dir("fused") / "pagedserve.stamp"
    stamp.write_text("another source, compile line, CPU or torch")
    assert not cpu_extensions.is_built("fused")
    stamp.write_text(cpu_extensions._stamp("fused"))
    assert cpu_extensions.is_built("fused")


def test_jobs_below_one_is_refused(tmp_path):
    out = _build(tmp_path, "--jobs", "0")
    assert out.returncode == 2 and out.stderr.strip().endswith("--jobs must be at least 1, got 0")
    assert list(tmp_path.iterdir()) == []
