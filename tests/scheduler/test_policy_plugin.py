"""A third-party policy package (tests/scheduler/lifo_policy_plugin, its own pyproject and
entry point) installed with pip: `pagedserve policies` lists it, the scheduler service
starts with it, and the scheduler core orders by it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.services.scheduler.policies.registry import installed_policies, load_policy
from pagedserve.services.scheduler.scheduler import Scheduler
from tests.scheduler.fakes import CountingAllocator, FakeWorker, make_request, run_step
from tests.services.conftest import ServiceStack, wait_for

PLUGIN = Path(__file__).parent / "lifo_policy_plugin"
REPO = Path(__file__).resolve().parents[2]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", "--disable-pip-version-check", *args], check=True,
                   timeout=300, capture_output=True)


@pytest.fixture(scope="module")
def lifo_installed(tmp_path_factory):
    build = tmp_path_factory.mktemp("lifo-build")
    _pip("install", "--no-deps", "--no-build-isolation", "--no-index", str(PLUGIN), "--target", str(build))
    # installed into a directory of its own (the suite's environment stays untouched),
    # put on the path of this process and of the processes the test starts
    sys.path.insert(0, str(build))
    yield build
    sys.path.remove(str(build))
    sys.modules.pop("pagedserve_lifo", None)


def test_pagedserve_policies_lists_the_plugin_beside_the_built_ins(lifo_installed):
    out = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "policies", "--json"], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60, env=_env(lifo_installed)).stdout
    listed = {p["name"]: p for p in map(json.loads, out.splitlines())}
    assert set(listed) >= {"fcfs", "priority", "sjf", "fair", "lifo"}
    assert listed["lifo"] == {"name": "lifo", "target": "pagedserve_lifo:LIFOPolicy",
                              "distribution": "pagedserve-lifo-policy"}
    assert listed["fcfs"]["distribution"] == "pagedserve"
    assert "lifo" in {p.name for p in installed_policies()}


def test_the_scheduler_core_orders_by_the_plugin(lifo_installed):
    scheduler = Scheduler(load_policy("lifo"), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024)
    allocator, worker = CountingAllocator(64, 4), FakeWorker(4)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", arrival_time=float(i), max_tokens=2))
    started = []
    while scheduler.has_requests():
        record = run_step(scheduler, allocator, worker)
        started += [r.request_id for r in record.plan.new_requests]
    assert started == ["r2", "r1", "r0"]


def test_the_scheduler_service_starts_with_the_plugin(lifo_installed, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env(lifo_installed)["PYTHONPATH"])
    stack = ServiceStack(tmp_path, args={"scheduler": ["--policy", "lifo"]})
    try:
        stack.start("scheduler")
        wait_for(lambda: (stack.stats("scheduler") or {}).get("policy") == {"name": "lifo", "options": {}}, 60,
                 "the scheduler's stats to name the lifo policy")
    finally:
        stack.close()


def _env(build: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(build), str(REPO)])}
