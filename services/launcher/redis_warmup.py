"""The embedded Redis grown to the offload tier's size at start, then emptied: where fresh memory faults in
slowly, the tier's growth in the first cold requests stalls a worker core. Never an operator's Redis."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis

from pagedserve.shared.meminfo import MIN_AVAILABLE, available_memory

log = logging.getLogger("pagedserve.up")

VALUE_BYTES = 1 << 20
VALUES_PER_PIPELINE = 16


def requests_arrived(client: redis.Redis, requests_stream: str | None) -> bool:
    if requests_stream is None:
        return False
    try:
        return client.xinfo_stream(requests_stream)["last-generated-id"] not in (b"0-0", "0-0")
    except redis.exceptions.ResponseError:  # not created yet
        return False


def warm_redis(url: str, nbytes: int, stop: threading.Event, value_bytes: int = VALUE_BYTES,
               requests_stream: str | None = None) -> int:
    """Bytes written (whole batches) then deleted; stops for `stop`, a short host, a Redis error or the
    first request on `requests_stream` (the cores are the requests' from then on)."""
    client = redis.Redis.from_url(url)
    prefix, value = f"pagedserve:warmup:{uuid.uuid4().hex}:", bytes(value_bytes)
    num_values, written, started = 0, 0, time.perf_counter()
    try:
        while written < nbytes and not stop.is_set():
            if requests_arrived(client, requests_stream):
                log.info("embedded redis warm-up stopped: requests arrived")
                break
            available = available_memory()
            if available is not None and available < MIN_AVAILABLE + VALUES_PER_PIPELINE * value_bytes:
                log.info("embedded redis warm-up stopped: %d MiB available", available >> 20)
                break
            pipe = client.pipeline(transaction=False)
            for i in range(num_values, num_values + VALUES_PER_PIPELINE):
                pipe.set(f"{prefix}{i}", value)
            num_values += VALUES_PER_PIPELINE  # before it runs: a batch that fails half-way is deleted too
            pipe.execute()
            written += VALUES_PER_PIPELINE * value_bytes
    except redis.exceptions.RedisError as e:
        log.info("embedded redis warm-up stopped: %s", e)
    finally:
        try:
            for first in range(0, num_values, VALUES_PER_PIPELINE):
                client.unlink(*(f"{prefix}{i}" for i in range(first, min(first + VALUES_PER_PIPELINE, num_values))))
        except redis.exceptions.RedisError as e:
            log.warning("embedded redis warm-up left values under %s*: %s", prefix, e)
        client.close()
    if written:
        log.info("embedded redis warmed: %d MiB in %.1f s", written >> 20, time.perf_counter() - started)
    return written


def start_warm_redis(url: str, nbytes: int, stop: threading.Event,
                     requests_stream: str | None = None) -> threading.Thread | None:
    """warm_redis on a daemon thread; None where there is nothing to warm (the tier is off)."""
    if nbytes <= 0:
        return None
    thread = threading.Thread(target=warm_redis, args=(url, nbytes, stop, VALUE_BYTES, requests_stream),
                              name="redis-warmup", daemon=True)
    thread.start()
    return thread
