"""`pagedserve up` with no REDIS_URL: an embedded Redis and the four services come up,
/ready turns 200, a chat completion works, and SIGINT (Ctrl-C) stops everything: every
child gone, the Redis port closed, exit 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import pytest
import redis

from tests.cli.helpers import (
    REPO,
    START_TIMEOUT_S,
    base_env,
    chat_once,
    free_port,
    pagedserve_argv,
    port_open,
    ready,
    wait_for,
)

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Output:
    """Every line the process prints, kept and searchable while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def find(self, pattern: str) -> list[re.Match]:
        return [m for line in list(self.lines) if (m := re.search(pattern, line))]

    def text(self) -> str:
        return "\n".join(self.lines[-60:])


def test_up_with_embedded_redis_serves_and_stops_on_sigint():
    port = free_port()
    env = base_env(PAGEDSERVE_LOG_LEVEL="info")
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([*pagedserve_argv(), "up", "--dtype", "float32", "--num-blocks", "256",
                             "--port", str(port), "--ready-timeout", str(START_TIMEOUT_S)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            process_group=0)
    out = Output(proc)
    try:
        def announced() -> bool:
            assert proc.poll() is None, f"pagedserve up exited {proc.returncode}:\n{out.text()}"
            return bool(out.find(rf"^pagedserve ready at http://127\.0\.0\.1:{port}$"))

        wait_for(announced, START_TIMEOUT_S + 10, "'pagedserve ready at' on stdout")
        # the services talk to it over a unix socket; tools can use the TCP port
        found = out.find(r"embedded redis ready at unix://(\S+)\?db=0 and redis://127\.0\.0\.1:(\d+)/0")[0]
        socket_path, redis_port = found.group(1), int(found.group(2))
        assert redis.Redis(unix_socket_path=socket_path).ping()
        pids = {m.group(1): int(m.group(2)) for m in out.find(r"started (\w+) \(pid (\d+)\)")}
        assert set(pids) == {"redis", "kvstore", "scheduler", "worker", "api"}, out.text()
        assert list(pids)[:2] == ["worker", "redis"]  # the worker loads while Redis starts
        assert port_open(redis_port)
        base_url = f"http://127.0.0.1:{port}"
        assert ready(base_url)
        assert chat_once(base_url)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, out.text()
        gone = [name for name, pid in pids.items() if _alive(pid)]
        assert not gone, f"still running after up exited: {gone}\n{out.text()}"
        assert not port_open(redis_port)
        assert not os.path.exists(socket_path)  # its working directory is removed with it
        assert not port_open(port)
        assert out.find("pagedserve up stopped")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
