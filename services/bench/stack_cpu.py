"""CPU time of a launched stack's processes per scheduler step, by service (Linux /proc).

The processes are the `pagedserve up` process's descendants, named by the service module
on their command line (services.<name>.main; redis-server -> redis; up itself ->
launcher). Steps are the scheduler's step ids between two snapshots, read from its stats
blob in Redis (url and key prefix taken from the scheduler's own command line).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

_SERVICE = re.compile(r"services\.(\w+)\.main")
_TICKS = os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def _ppid_and_cpu_s(pid: int) -> tuple[int, float]:
    """Parent pid and user + system seconds (fields 4, 14 and 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _service_name(cmdline: list[str]) -> str:
    found = _SERVICE.search(" ".join(cmdline))
    if found:
        return found.group(1)
    return "redis" if any("redis-server" in part for part in cmdline) else "launcher"


def _option(cmdline: list[str], name: str) -> str | None:
    return cmdline[cmdline.index(name) + 1] if name in cmdline[:-1] else None


class StackCpu:
    """snapshot() before and after a load; per_step(a, b) -> {"cpu_ms_per_step_<service>": ms, "steps": n}."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid

    def _tree(self) -> dict[int, float]:
        """CPU seconds of the root and its descendants, by pid."""
        parent, cpu = {}, {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    parent[int(entry)], cpu[int(entry)] = _ppid_and_cpu_s(int(entry))
                except (OSError, IndexError, ValueError):
                    continue  # gone meanwhile
        tree, frontier = {}, [self.root_pid]
        while frontier:
            pid = frontier.pop()
            if pid in cpu:
                tree[pid] = cpu[pid]
                frontier.extend(child for child, ppid in parent.items() if ppid == pid)
        return tree

    def snapshot(self) -> dict:
        cpu: dict[str, float] = {}
        step_id = None
        for pid, seconds in self._tree().items():
            try:
                cmdline = _cmdline(pid)
            except OSError:
                continue
            name = _service_name(cmdline)
            if name == "scheduler":
                step_id = self._step_id(cmdline)
            cpu[name] = cpu.get(name, 0.0) + seconds
        return {"cpu_s": cpu, "step_id": step_id}

    def snapshot_after_a_step(self, timeout_s: float = 5.0) -> dict:
        """snapshot() once the stats name a step (ids start at a wall-clock base: 0 counts nothing)."""
        deadline = time.monotonic() + timeout_s
        while not (snap := self.snapshot())["step_id"] and time.monotonic() < deadline:
            time.sleep(0.05)
        return snap

    @staticmethod
    def _step_id(cmdline: list[str]) -> int | None:
        import msgpack
        import redis

        from pagedserve.shared.streams import Keys

        url, prefix = _option(cmdline, "--redis-url"), _option(cmdline, "--prefix")
        if url is None or prefix is None:
            return None
        with redis.Redis.from_url(url) as r:
            blob = r.get(Keys(prefix).stats("scheduler"))
        return None if blob is None else int(msgpack.unpackb(blob, raw=False).get("step_id", 0))

    @staticmethod
    def per_step(before: dict, after: dict) -> dict:
        if not before["step_id"] or after["step_id"] is None or after["step_id"] <= before["step_id"]:
            return {}
        steps = after["step_id"] - before["step_id"]
        result = {"steps": steps}
        for name in sorted(after["cpu_s"]):
            used = after["cpu_s"][name] - before["cpu_s"].get(name, 0.0)
            result[f"cpu_ms_per_step_{name}"] = round(used * 1000 / steps, 3)
        return result
