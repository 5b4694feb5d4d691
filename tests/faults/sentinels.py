"""Redis Sentinel as real processes for the tests: a master, one replica, three sentinels."""

from __future__ import annotations

import shutil
import subprocess

import redis

from pagedserve.services.launcher.embedded_redis import free_port
from tests.waiting import wait_for

SERVICE = "pagedserve"
REDIS_SERVER = shutil.which("redis-server")


class Sentinels:
    """redis-server master + replica and 3 sentinels (quorum 2), all on 127.0.0.1."""

    def __init__(self, tmp_path) -> None:
        self.dir = tmp_path
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}/0"
        server = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]
        self._spawn("master", [REDIS_SERVER, "--port", str(self.master_port), *server])
        self._spawn("replica", [REDIS_SERVER, "--port", str(self.replica_port), *server,
                                "--replicaof", "127.0.0.1", str(self.master_port)])
        for i, port in enumerate(self.sentinel_ports):
            conf = tmp_path / f"sentinel-{i}.conf"  # a sentinel rewrites its own config
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                            f"sentinel failover-timeout {SERVICE} 10000\n")
            self._spawn(f"sentinel-{i}", [REDIS_SERVER, str(conf), "--sentinel"])
        wait_for(self._settled, 60, "the sentinels to see the replica and each other", interval=0.2)

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.dir / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def _settled(self) -> bool:
        try:
            for port in self.sentinel_ports:
                with redis.Redis(port=port, socket_timeout=1) as s:
                    master = s.sentinel_master(SERVICE)
                    if master["num-other-sentinels"] != 2 or master["num-slaves"] != 1:
                        return False
            with redis.Redis(port=self.replica_port) as r:
                return r.info("replication")["master_link_status"] == "up"
        except redis.RedisError:
            return False

    def wait_for_every_sentinel_to_name(self, port: int) -> None:
        """The sentinel that led the failover knows first; the others learn it from its hellos."""
        def named() -> bool:
            try:
                return all(self._master_port_at(p) == port for p in self.sentinel_ports)
            except redis.RedisError:
                return False
        wait_for(named, 30, f"every sentinel to name port {port} the master", interval=0.1)

    def _master_port_at(self, sentinel_port: int) -> int:
        with redis.Redis(port=sentinel_port, socket_timeout=1) as s:
            return int(s.sentinel_get_master_addr_by_name(SERVICE)[1])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
