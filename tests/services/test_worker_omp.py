"""The worker's libgomp spin default: set before torch loads, never over the user's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.gpu_worker import main


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


def test_spin_count_defaults_to_the_measured_value(clean_env):
    main._omp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == main.GOMP_SPINCOUNT == "10000"


def test_an_explicit_spin_count_is_kept(clean_env, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    main._omp_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == "300000"


def test_an_explicit_wait_policy_gets_no_spin_count(clean_env, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    main._omp_defaults()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_the_worker_module_does_not_load_torch_before_the_default_is_set():
    # libgomp reads GOMP_SPINCOUNT once, when torch loads it: importing the entry point and
    # building its config must leave torch unloaded
    code = ("import sys, argparse; from services.gpu_worker import main as m; p = argparse.ArgumentParser(); "
            "m.add_arguments(p); m.build_config(p.parse_args([])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
