"""The api side of `pagedserve up`: is the port free, and the api replicas' commands.

N replicas share one port (SO_REUSEPORT), each under a stable api id so a restart finds its requests.
"""

from __future__ import annotations

import socket


def port_taken(host: str, port: int) -> str | None:
    """Why the api cannot listen on host:port (e.g. another server has it), or None.
    The probe binds without SO_REUSEPORT, so a port held by replicas counts as taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there?)"
    return None


def api_replicas(argv: list[str], replicas: int, host: str, port: int) -> list[tuple[str, list[str]]]:
    """(name, argv) of each api replica; several are named api<i> with the id <host>-<port>-<i>."""
    if replicas == 1:
        return [("api", argv)]
    name = socket.gethostname()
    return [(f"api{i}", [*argv, "--reuse-port", "--api-id", f"{name}-{port}-{i}"]) for i in range(replicas)]
