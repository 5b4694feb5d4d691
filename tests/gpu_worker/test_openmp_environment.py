"""The worker process's OpenMP settings: its team waits passively (no spinning on cores the control
plane shares) unless the environment says otherwise, and --threads sizes it; both before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.services.gpu_worker.main import OMP_WAIT_POLICY, set_openmp_environment


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_passive_by_default_and_threads_when_given(threads):
    environ: dict[str, str] = {}
    set_openmp_environment(threads, environ)
    expected = {"OMP_WAIT_POLICY": "PASSIVE"} | ({} if threads is None else {"OMP_NUM_THREADS": str(threads)})
    assert environ == expected and OMP_WAIT_POLICY == "PASSIVE"


def test_the_environments_wait_policy_wins():
    environ = {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "4"}
    set_openmp_environment(None, environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "4"}


def test_torchs_openmp_never_spins_when_set_before_torch_loads():
    code = ("from pagedserve.services.gpu_worker.main import set_openmp_environment\n"
            "set_openmp_environment(None)\n"
            "import torch\n"
            "torch.ones(8).sum()\n")
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"OMP_DISPLAY_ENV": "VERBOSE"}
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "GOMP_SPINCOUNT = '0'" in done.stdout + done.stderr  # libgomp's default spins 300,000 rounds
