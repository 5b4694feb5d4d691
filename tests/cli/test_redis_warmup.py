"""The embedded Redis's warm-up on the real Redis: what it is asked, nothing left, and its stops."""

from __future__ import annotations

import threading

import pytest
import redis

from pagedserve.services.launcher import embedded_redis, redis_warmup
from pagedserve.services.launcher.supervisor import Supervisor
from tests.cli.helpers import REDIS_URL

VALUE = 64 << 10


def _warmup_keys(client: redis.Redis) -> list[bytes]:
    return list(client.scan_iter(match="pagedserve:warmup:*", count=1000))


def test_it_writes_whole_batches_then_deletes_them_all():
    client = redis.Redis.from_url(REDIS_URL)
    before = client.info("stats")["total_commands_processed"]
    written = redis_warmup.warm_redis(REDIS_URL, 3 * redis_warmup.VALUES_PER_PIPELINE * VALUE - 1, threading.Event(), VALUE)
    assert written == 3 * redis_warmup.VALUES_PER_PIPELINE * VALUE  # rounded up to whole batches
    assert _warmup_keys(client) == []
    assert client.info("stats")["total_commands_processed"] - before >= 3 * redis_warmup.VALUES_PER_PIPELINE + 3  # sets, unlinks
    client.close()


def test_a_stop_before_it_starts_writes_nothing():
    stop = threading.Event()
    stop.set()
    assert redis_warmup.warm_redis(REDIS_URL, 1 << 30, stop, VALUE) == 0


def test_it_stops_while_the_host_is_short_of_memory(monkeypatch):
    monkeypatch.setattr(redis_warmup, "available_memory", lambda: redis_warmup.MIN_AVAILABLE)
    assert redis_warmup.warm_redis(REDIS_URL, 1 << 30, threading.Event(), VALUE) == 0


def test_a_redis_that_is_not_there_ends_it_quietly():
    assert redis_warmup.warm_redis("redis://127.0.0.1:1/0", 1 << 20, threading.Event(), VALUE) == 0


def test_nothing_to_warm_with_the_tier_off():
    assert redis_warmup.start_warm_redis(REDIS_URL, 0, threading.Event()) is None


def test_the_thread_warms_and_ends():
    thread = redis_warmup.start_warm_redis(REDIS_URL, redis_warmup.VALUES_PER_PIPELINE * VALUE, threading.Event())
    thread.join(timeout=30)
    assert not thread.is_alive()
    client = redis.Redis.from_url(REDIS_URL)
    assert _warmup_keys(client) == []
    client.close()


def test_the_embedded_redis_env_keeps_an_operator_s_tunables():
    env = embedded_redis.redis_env({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{embedded_redis.MALLOC_TUNABLES}"}
    assert embedded_redis.redis_env({})["GLIBC_TUNABLES"] == embedded_redis.MALLOC_TUNABLES


def _faults_and_rss(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/stat") as f:
        minflt = int(f.read().rsplit(")", 1)[1].split()[7])
    with open(f"/proc/{pid}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return minflt, rss_kib << 10


def test_the_embedded_redis_keeps_what_the_warm_up_grew():
    supervisor = Supervisor()
    embedded = embedded_redis.EmbeddedRedis(supervisor)
    url = embedded.start()
    client = redis.Redis.from_url(url)
    try:
        if client.info("memory")["mem_allocator"] != "libc":
            pytest.skip(f"{embedded.executable} is not built on glibc's malloc")
        warmed = 64 * VALUE * redis_warmup.VALUES_PER_PIPELINE  # 64 MiB
        assert redis_warmup.warm_redis(url, warmed, threading.Event(), VALUE * 16) == warmed
        pid = embedded.child.proc.pid
        faults_before, rss_before = _faults_and_rss(pid)
        assert rss_before >= warmed
        block = bytes(368 << 10)  # a SmolLM2 bf16 block of 16 tokens
        pipe = client.pipeline(transaction=False)
        for i in range(warmed // len(block) - 8):
            pipe.set(f"pagedserve:test-block:{i}", block)
        pipe.execute()
        faults_after, rss_after = _faults_and_rss(pid)
        assert faults_after - faults_before < (warmed >> 12) // 10  # a tenth of the pages it would fault in
        assert rss_after - rss_before < warmed // 10
    finally:
        client.close()
        supervisor.stop_all(grace_s=5.0)
        embedded.cleanup()


def test_it_stops_at_the_first_request():
    client = redis.Redis.from_url(REDIS_URL)
    stream = "pagedserve-test-warmup:requests"
    client.delete(stream)
    try:
        assert redis_warmup.warm_redis(REDIS_URL, VALUE, threading.Event(), VALUE, stream) == VALUE * 16
        client.xgroup_create(stream, "scheduler", id="0", mkstream=True)  # as the scheduler makes it at start
        assert redis_warmup.warm_redis(REDIS_URL, VALUE, threading.Event(), VALUE, stream) == VALUE * 16
        client.xadd(stream, {"m": b"x"})
        client.xtrim(stream, maxlen=0)  # the request taken and trimmed: still arrived
        assert redis_warmup.warm_redis(REDIS_URL, 1 << 30, threading.Event(), VALUE, stream) == 0
        assert _warmup_keys(client) == []
    finally:
        client.delete(stream)
        client.close()
