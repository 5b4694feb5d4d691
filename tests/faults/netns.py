"""Hosts for the tests, made of Linux network namespaces: each "host" is a namespace with one
veth link to a bridge in the test's own namespace, its own address on 10.34.0.0/24, its own
loopback, and its own /tmp (a tmpfs mounted in the mount namespace `ip netns exec` makes), so
a process in one reaches another only over that network."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid

SUBNET = "10.34.{}.{}"


def available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"ps34probe{uuid.uuid4().hex[:4]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """A bridge (the test's side: .1) and one namespace per host name (.2, .3, ...)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:4]
        self.net = int(tag, 16) % 200 + 20  # 10.34.<net>.0/24, unlikely to collide with another run
        self.bridge, self.tag = f"br34{tag}", tag
        self.addresses: dict[str, str] = {}
        self.links: dict[str, str] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET.format(self.net, 1)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> str:
        """A new host; its address."""
        ns, link = f"{name}{self.tag}", f"v{self.tag}{name}"[:15]
        address = SUBNET.format(self.net, len(self.addresses) + 2)
        _ip("netns", "add", ns)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.addresses[name], self.links[name] = address, link
        return address

    def argv(self, name: str, command: list[str]) -> list[str]:
        """`command` run on host `name`, with a /tmp of its own."""
        inner = f"mount -t tmpfs tmpfs /tmp && exec {shlex.join(command)}"
        return ["ip", "netns", "exec", f"{name}{self.tag}", "sh", "-c", inner]

    def link(self, name: str, up: bool) -> None:
        _ip("link", "set", self.links[name], "up" if up else "down")

    def close(self) -> None:
        for name in self.addresses:
            subprocess.run(["ip", "netns", "del", f"{name}{self.tag}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
