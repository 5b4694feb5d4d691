"""Redis clients from a URL, plain or through Redis Sentinel.

    redis://[[user]:password@]host:port/db, rediss://..., unix://...   as redis-py reads them
    redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db][?sentinel_password=P]

A sentinel URL names the sentinels (any one that answers will do) and the service name they
monitor; every new connection asks them where that service's master is, so after a failover
the clients reconnect to the promoted replica on their own. The password is the master's;
the sentinels' own, if they have one, is `sentinel_password`. A connection to a demoted
master (READONLY) is dropped and made again to the new one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from pagedserve.shared.config import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
_HOST_PORT = re.compile(r"(?:\[([^\]]+)\]|([^:\[\]]+))(?::(\d+))?")
SENTINEL_TIMEOUT_S = 2.0  # one sentinel that does not answer is skipped after this


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def parse_sentinel_url(url: str) -> SentinelURL | None:
    """The parts of a redis+sentinel:// URL; None for any other URL. ConfigError if malformed."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        return None
    hosts = parts.netloc.rpartition("@")[2]
    sentinels = []
    for item in hosts.split(","):
        m = _HOST_PORT.fullmatch(item)
        if m is None:
            raise ConfigError(f"redis url {url!r}: bad sentinel address {item!r} (host:port or [ipv6]:port)")
        sentinels.append((m.group(1) or m.group(2), int(m.group(3) or 26379)))
    path = [p for p in parts.path.split("/") if p]
    if not 1 <= len(path) <= 2:
        raise ConfigError(f"redis url {url!r}: expected {SENTINEL_SCHEME}://host:port[,host:port...]/service[/db]")
    if len(path) == 2 and not path[1].isdigit():
        raise ConfigError(f"redis url {url!r}: db {path[1]!r} must be a number")
    credentials = parts.netloc.rpartition("@")[0]
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    query = parse_qs(parts.query)
    return SentinelURL(tuple(sentinels), unquote(path[0]), int(path[1]) if len(path) == 2 else 0,
                       unquote(username) or None, unquote(password) or None,
                       (query.get("sentinel_password") or [None])[0])


def check_redis_url(url: str) -> None:
    """ConfigError naming --redis-url unless it is one of the forms above."""
    if not url.startswith(("redis://", "rediss://", "unix://", f"{SENTINEL_SCHEME}://")):
        raise ConfigError(f"--redis-url={url!r}: expected redis://, rediss://, unix:// or {SENTINEL_SCHEME}://")
    try:
        parse_sentinel_url(url)
    except ConfigError as e:
        raise ConfigError(f"--redis-url: {e}") from None


def _sentinel_kwargs(s: SentinelURL, kwargs: dict[str, Any]) -> tuple[dict, dict]:
    """(kwargs of the connections to the master, kwargs of those to the sentinels)."""
    master = dict(kwargs, db=s.db, username=s.username, password=s.password)
    to_sentinels = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S,
                    "password": s.sentinel_password}
    return master, to_sentinels


class BlockingSentinelConnectionPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The master's connections, at most max_connections; a caller past that waits for one."""


def async_client(url: str, blocking: bool = False, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client (not yet connected); `blocking`: a pool that waits for a free connection
    (max_connections, timeout in kwargs) instead of failing."""
    s = parse_sentinel_url(url)
    if s is None:
        if blocking:
            return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(url, **kwargs))
        return aioredis.Redis.from_url(url, **kwargs)
    master, to_sentinels = _sentinel_kwargs(s, kwargs)
    manager = aiosentinel.Sentinel(s.sentinels, sentinel_kwargs=to_sentinels)
    pool_class = BlockingSentinelConnectionPool if blocking else aiosentinel.SentinelConnectionPool
    return manager.master_for(s.service, redis_class=aioredis.Redis, connection_pool_class=pool_class, **master)


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking-IO client (healthchecks, tools)."""
    s = parse_sentinel_url(url)
    if s is None:
        return redis.Redis.from_url(url, **kwargs)
    master, to_sentinels = _sentinel_kwargs(s, kwargs)
    return redis.sentinel.Sentinel(s.sentinels, sentinel_kwargs=to_sentinels).master_for(s.service, **master)
