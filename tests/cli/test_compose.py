"""docker-compose.yml: its structure, and its commands really serving a chat completion.

No Docker engine is needed: the second test runs each pagedserve container's command and
environment as a local process (REDIS_URL pointed at the local Redis, a fresh prefix, the
api on a free local port, a float32 worker with a small pool), then runs each container's
healthcheck command and serves one real chat completion through that stack.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from services.launcher.supervisor import Child, Supervisor
from tests.cli.helpers import (
    REDIS_URL,
    REPO,
    START_TIMEOUT_S,
    base_env,
    chat_once,
    free_port,
    pagedserve_argv,
    ready,
    wait_for,
)

COMPOSE = REPO / "docker-compose.yml"
BACKEND = ("kvstore", "scheduler", "gpu_worker_cpu")
SUBCOMMAND = {"kvstore": "kvstore", "scheduler": "scheduler", "gpu_worker": "worker", "gpu_worker_cpu": "worker",
              "api": "api"}


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} and ${VAR}, from this environment."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: os.environ.get(m.group(1)) or (m.group(2) or ""), value)


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_compose_structure(services):
    assert set(services) == {"redis", *SUBCOMMAND}
    assert services["redis"]["image"].startswith("redis:7")
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, sub in SUBCOMMAND.items():
        svc = services[name]
        assert svc["command"][:2] == ["pagedserve", sub], name
        assert svc["environment"]["REDIS_URL"] == "redis://redis:6379/0", name
        assert "PAGEDSERVE_PREFIX" in svc["environment"], name
        assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
        for dep, cond in svc["depends_on"].items():
            assert cond["condition"] == "service_healthy" and "healthcheck" in services[dep], (name, dep)
        assert svc["healthcheck"]["test"][:4] == ["CMD", "pagedserve", "healthcheck", sub], name
    assert services["api"]["ports"] == ["8000:8000"]
    assert services["api"]["command"][services["api"]["command"].index("--host") + 1] == "0.0.0.0"
    gpu = services["gpu_worker"]
    assert gpu["profiles"] == ["gpu"] and "--device" in gpu["command"] and "cuda" in gpu["command"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert "profiles" not in services["gpu_worker_cpu"]  # the CPU worker is the default


def _local_argv(services: dict, name: str, extra: list[str]) -> list[str]:
    command = services[name]["command"]
    return [*pagedserve_argv(), *command[1:], *extra]


def _local_env(services: dict, name: str, prefix: str) -> dict[str, str]:
    env = {k: _interpolate(str(v)) for k, v in services[name]["environment"].items()}
    return base_env(**{**env, "REDIS_URL": REDIS_URL, "PAGEDSERVE_PREFIX": prefix})


@pytest.mark.slow
def test_compose_commands_serve_a_chat_completion(services, prefix):
    port = free_port()
    overrides = {"gpu_worker_cpu": ["--dtype", "float32", "--num-blocks", "256"],
                 "api": ["--host", "127.0.0.1", "--port", str(port)]}
    sup = Supervisor()
    try:
        for name in (*BACKEND, "api"):
            sup.start(Child(name, _local_argv(services, name, overrides.get(name, [])),
                            _local_env(services, name, prefix), forward=False))
        base_url = f"http://127.0.0.1:{port}"

        def stack_ready() -> bool:
            dead = sup.first_dead()
            assert dead is None, f"{dead.name} exited {dead.returncode()}:\n" + "\n".join(dead.tail())
            return ready(base_url)

        wait_for(stack_ready, START_TIMEOUT_S, "GET /ready == 200")
        for name in (*BACKEND, "api"):
            test = services[name]["healthcheck"]["test"]
            check = [*pagedserve_argv(), *test[2:]]
            if name == "api":
                check[-1] = base_url + "/health"
            out = subprocess.run(check, env=_local_env(services, name, prefix), cwd=REPO, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, (name, out.stdout, out.stderr)
        assert chat_once(base_url)
    finally:
        sup.stop_all(grace_s=20.0)
    for child in sup.children:  # SIGTERM is a clean stop: exit 0
        assert child.returncode() == 0, (child.name, child.returncode(), child.tail())
