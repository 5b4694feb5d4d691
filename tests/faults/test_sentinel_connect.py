"""redis+sentinel:// URLs: parsed exactly, malformed ones refused naming the part, and the
clients (asyncio plain and blocking-pool, sync) finding the master through real sentinels,
then the promoted replica after kill -9 of the master. No model: seconds."""

from __future__ import annotations

import asyncio

import pytest
import redis

from pagedserve.shared.config import ConfigError
from pagedserve.shared.redis_connect import (
    SentinelURL,
    async_client,
    check_redis_url,
    parse_sentinel_url,
    sync_client,
)
from tests.faults.sentinels import REDIS_SERVER, Sentinels
from tests.waiting import wait_for


def test_parse_names_every_part():
    url = "redis+sentinel://user:pw@s1:26380,[::1]:26381,s3/mymaster/2?sentinel_password=sp"
    assert parse_sentinel_url(url) == SentinelURL((("s1", 26380), ("::1", 26381), ("s3", 26379)), "mymaster", 2,
                                                  "user", "pw", "sp")
    assert parse_sentinel_url("redis+sentinel://s1/m") == SentinelURL((("s1", 26379),), "m")
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None
    assert parse_sentinel_url("unix:///tmp/redis.sock?db=0") is None


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://s1:port/m", "bad sentinel address 's1:port'"),
    ("redis+sentinel:///m", "bad sentinel address ''"),
    ("redis+sentinel://s1", "expected redis+sentinel://host:port"),
    ("redis+sentinel://s1/m/zero", "db 'zero' must be a number"),
])
def test_malformed_urls_are_refused_naming_the_part(url, why):
    with pytest.raises(ConfigError, match=why.replace("+", r"\+")):
        parse_sentinel_url(url)


def test_check_redis_url_names_the_option():
    for url in ("redis://h:6379/0", "rediss://h", "unix:///tmp/r.sock", "redis+sentinel://s1,s2/m/0"):
        check_redis_url(url)
    with pytest.raises(ConfigError, match=r"--redis-url='http://h': expected redis://"):
        check_redis_url("http://h")
    with pytest.raises(ConfigError, match=r"--redis-url: redis url 'redis\+sentinel://s1/m/x': db 'x'"):
        check_redis_url("redis+sentinel://s1/m/x")


@pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server (it also runs the sentinels)")
def test_clients_follow_the_master_across_a_failover(tmp_path):
    cluster = Sentinels(tmp_path)
    try:
        sync = sync_client(cluster.url, socket_timeout=1)
        sync.set("k", "before")
        assert redis.Redis(port=cluster.master_port).get("k") == b"before"

        async def roundtrip(key: str, blocking: bool) -> bytes | None:
            pool = {"max_connections": 2, "timeout": 5} if blocking else {}
            client = async_client(cluster.url, blocking=blocking, **pool)
            try:
                await client.set(key, "v")
                return await client.get(key)
            finally:
                await client.aclose()

        assert asyncio.run(roundtrip("a", False)) == b"v" and asyncio.run(roundtrip("b", True)) == b"v"
        cluster.procs["master"].kill()
        cluster.procs["master"].wait()

        def promoted():
            try:
                return sync.set("k", "after")
            except (redis.RedisError, OSError):
                return False

        wait_for(promoted, 60, "the sentinels to promote the replica", interval=0.1)
        cluster.wait_for_every_sentinel_to_name(cluster.replica_port)
        assert redis.Redis(port=cluster.replica_port).get("k") == b"after"
        assert asyncio.run(roundtrip("c", True)) == b"v"
    finally:
        cluster.close()
