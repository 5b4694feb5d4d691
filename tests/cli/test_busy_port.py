"""A port already taken: `pagedserve up` and `pagedserve api` fail at once, saying so, with a
non-zero exit and no process left behind; `--api-replicas N` share one port."""

from __future__ import annotations

import socket
import subprocess
import sys

from pagedserve.services.launcher.api_replicas import api_replicas, port_taken
from pagedserve.services.launcher.up import add_arguments, service_commands
from tests.cli.helpers import REPO, base_env, pagedserve_argv


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def _children_of(pid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return out.split()


def test_up_on_a_busy_port_fails_at_once():
    with _listener() as sock:
        port = sock.getsockname()[1]
        proc = subprocess.Popen([*pagedserve_argv(), "up", "--port", str(port)], cwd=REPO, env=base_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 3, out
        assert f"cannot listen on 127.0.0.1:{port}" in out and "another server" in out
        assert "embedded redis" not in out.lower()  # nothing was started
        assert _children_of(proc.pid) == []


def test_api_on_a_busy_port_exits_before_loading_anything():
    with _listener() as sock:
        port = sock.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pagedserve.services.api.main", "--port", str(port)], cwd=REPO,
                              env=base_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "another server" in proc.stderr


def test_port_probe_sees_replicas_holding_the_port():
    with socket.socket() as a:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        a.bind(("127.0.0.1", 0))
        a.listen(1)
        port = a.getsockname()[1]
        assert port_taken("127.0.0.1", port) is not None
        with socket.socket() as b:  # a second replica joins the same port
            b.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            b.bind(("127.0.0.1", port))
    assert port_taken("127.0.0.1", port) is None


def test_api_replicas_share_the_port_with_their_own_ids():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--api-replicas", "3", "--port", "8123"])
    apis = [(name, argv) for name, argv in service_commands(args, "redis://x") if name.startswith("api")]
    assert [name for name, _ in apis] == ["api0", "api1", "api2"]
    ids = [argv[argv.index("--api-id") + 1] for _, argv in apis]
    assert len(set(ids)) == 3 and all(i.endswith(f"-8123-{n}") for n, i in enumerate(ids))
    assert all("--reuse-port" in argv and argv[argv.index("--port") + 1] == "8123" for _, argv in apis)
    assert api_replicas(["api"], 1, "127.0.0.1", 8123) == [("api", ["api"])]
