"""Loading the C++ kernels survives what a killed build leaves behind, and can be switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.gpu_worker import cpu_extensions

LOAD = "from services.gpu_worker import cpu_extensions as c; print(c.load('fused') is not None)"


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
