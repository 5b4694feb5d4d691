"""Loading the C++ kernels survives what a killed build leaves behind, and can be switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.services.gpu_worker.kernels import cpu_extensions

LOAD = "from pagedserve.services.gpu_worker.kernels import cpu_extensions as c; print(c.load('fused') is not None)"


@pytest.mark.skipif(cpu_extensions.load("fused") is None, reason="the C++ kernels could not be built here")
def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load():
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory("pagedserve_cpu_fused", verbose=False))
    (build_dir / "lock").touch()  # what torch leaves when its builder dies mid-build
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr
    assert not (build_dir / "lock").exists()


def test_switched_off_by_the_environment():
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PAGEDSERVE_CPU_KERNELS": "0"})
    assert done.stdout.strip() == "False", done.stderr


def test_a_header_change_changes_the_compile_line(tmp_path, monkeypatch):
    # torch rebuilds an extension when its source or compile line changes, never for a header
    header = tmp_path / "work.h"
    header.write_text("// one\n")
    monkeypatch.setitem(cpu_extensions.HEADERS, "decode", [header])
    before = cpu_extensions.compile_flags("decode")
    header.write_text("// two\n")
    after = cpu_extensions.compile_flags("decode")
    assert before[:4] == after[:4] == ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
    assert before[4].startswith("-DPAGEDSERVE_HEADERS_HASH=") and before[4] != after[4]
    cpu = f"-DPAGEDSERVE_CPU={cpu_extensions.cpu_digest()}"
    assert before[5] == after[5] == cpu  # the CPU the build is for
    assert cpu_extensions.compile_flags("sample") == [*before[:4], cpu]  # no headers: no hash


def test_every_header_a_source_includes_is_hashed():
    for name, source in cpu_extensions.SOURCES.items():
        listed = {h.resolve() for h in cpu_extensions.HEADERS.get(name, [])}
        for path in [source, *cpu_extensions.HEADERS.get(name, [])]:  # and what the headers include in turn
            included = {(path.parent / line.split('"')[1]).resolve() for line in path.read_text().splitlines()
                        if line.startswith('#include "')}
            assert included <= listed, (name, path.name)
