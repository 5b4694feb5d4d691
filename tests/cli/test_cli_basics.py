"""The `pagedserve` command itself: help lists the commands, bad config fails at start with
the option named, and healthcheck reports a service with no heartbeat as unhealthy."""

from __future__ import annotations

import subprocess

from tests.cli.helpers import REDIS_URL, REPO, base_env, free_port, pagedserve_argv


def _run(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*pagedserve_argv(), *args], cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_command():
    out = _run("--help")
    assert out.returncode == 0
    for command in ("up", "api", "scheduler", "kvstore", "worker", "generate", "healthcheck"):
        assert f"    {command}" in out.stdout, out.stdout


def test_unknown_command_is_an_error():
    out = _run("serve")
    assert out.returncode == 2
    assert "invalid choice: 'serve'" in out.stderr


def test_up_rejects_bad_config_before_starting_anything():
    port = free_port()
    out = _run("up", "--kv-cache-memory", "lots", "--port", str(port))
    assert out.returncode == 2
    assert "not a memory size: 'lots'" in out.stderr
    assert "started" not in out.stdout + out.stderr  # no child was started
    out = _run("up", "--model", "no-such-model", "--port", str(port))
    assert out.returncode == 2 and "--model='no-such-model'" in out.stderr


def test_generate_rejects_bad_max_tokens():
    out = _run("generate", "hi", "--max-tokens", "0")
    assert out.returncode == 2 and "--max-tokens=0" in out.stderr


def test_healthcheck_without_heartbeat_is_unhealthy(prefix):
    out = _run("healthcheck", "scheduler", "--redis-url", REDIS_URL, "--prefix", prefix)
    assert out.returncode == 1
    assert f"scheduler: unhealthy ({prefix}:hb:scheduler)" in out.stdout
    out = _run("healthcheck", "api", "--url", f"http://127.0.0.1:{free_port()}/health", "--timeout", "1")
    assert out.returncode == 1 and "api: unhealthy" in out.stdout
