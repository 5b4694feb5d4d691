"""`pagedserve healthcheck NAME`: exit 0 if alive, else 1. Services: their heartbeat key (worker:
--worker-id, or any); api: GET --url answers 200.
"""

from __future__ import annotations

import argparse
import sys

from pagedserve.shared import redis_io
from pagedserve.shared.streams import Keys

SERVICES = ("scheduler", "kvstore", "worker", "api")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=SERVICES, help="which service to check")
    redis_io.add_common_arguments(parser)
    parser.add_argument("--worker-id", default=None, help="worker: check this worker (default: any worker)")
    parser.add_argument("--url", default="http://127.0.0.1:8000/health", help="api: the URL to GET")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")


def _heartbeat_alive(args: argparse.Namespace) -> tuple[bool, str]:
    from pagedserve.shared.redis_connect import sync_client

    keys = Keys(args.prefix)
    client = sync_client(args.redis_url, socket_connect_timeout=args.timeout, socket_timeout=args.timeout)
    try:
        if args.name == "worker" and args.worker_id is None:
            found = next(iter(client.scan_iter(match=keys.heartbeat_pattern("worker"), count=100)), None)
            return found is not None, keys.heartbeat_pattern("worker")
        name = f"worker:{args.worker_id}" if args.name == "worker" else args.name
        return bool(client.exists(keys.heartbeat(name))), keys.heartbeat(name)
    finally:
        client.close()


def _api_alive(args: argparse.Namespace) -> tuple[bool, str]:
    import httpx

    try:
        return httpx.get(args.url, timeout=args.timeout).status_code == 200, args.url
    except httpx.HTTPError:
        return False, args.url


def run(args: argparse.Namespace) -> int:
    try:
        ok, what = _api_alive(args) if args.name == "api" else _heartbeat_alive(args)
    except Exception as e:  # Redis down, bad URL: unhealthy, and say why
        print(f"{args.name}: unhealthy ({type(e).__name__}: {e})")
        return 1
    print(f"{args.name}: {'healthy' if ok else 'unhealthy'} ({what})")
    return 0 if ok else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pagedserve healthcheck")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
