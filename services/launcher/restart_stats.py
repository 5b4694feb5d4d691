"""The launcher's restart counts in Redis, as the "launcher" stats blob ({"restarts": {name: n}}),
which the api's /metrics reports as pagedserve:service_restarts_total{service=name}."""

from __future__ import annotations

import logging

import msgpack

from pagedserve.shared.redis_connect import sync_client
from pagedserve.shared.redis_io import REDIS_ERRORS
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.up")


class RestartStats:
    """Callable: publish {name: restarts}; Redis down is logged, the next call writes it again."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.client = sync_client(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.key = Keys(prefix).stats("launcher")

    def __call__(self, restarts: dict[str, int]) -> None:
        try:
            self.client.set(self.key, msgpack.packb({"restarts": restarts}, use_bin_type=True))
        except REDIS_ERRORS as e:
            log.warning("restart counts not published (redis: %s); retrying later", e)

    def close(self) -> None:
        self.client.close()
