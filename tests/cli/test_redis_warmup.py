"""The embedded Redis's warm-up on the real Redis: what it is asked, nothing left, and its stops."""

from __future__ import annotations

import threading

import redis

from pagedserve.services.launcher import redis_warmup
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
