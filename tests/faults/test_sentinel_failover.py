"""Redis that fails over: a master, one replica and three sentinels (real redis-server
processes on spare ports), the stack connected through the sentinels
(redis+sentinel://.../pagedserve). kill -9 of the master under NUM_REQUESTS in-flight greedy
requests: the sentinels promote the replica, every service reconnects to it on its own,
and every client gets the text of the fault-free run; no client hangs (each has a deadline),
the kvstore holds 0 blocks once idle. The time without Redis (kill to the first write the
promoted replica accepts through the sentinels) is printed.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from pagedserve.shared.redis_connect import sync_client
from tests.faults.sentinels import REDIS_SERVER, Sentinels
from tests.faults.test_restarts import NUM_REQUESTS, run_clients, start_api
from tests.services.conftest import ServiceStack, wait_for

pytestmark = pytest.mark.slow


@pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server (it also runs the sentinels)")
def test_kill_9_of_the_master_fails_over_and_loses_nothing(tmp_path):
    cluster = Sentinels(tmp_path)
    stack = ServiceStack(tmp_path, prefix=f"sentinel-{uuid.uuid4().hex[:8]}", redis_url=cluster.url)
    api = None
    try:
        for service in ("scheduler", "kvstore", "worker"):
            stack.start(service, wait=False)
        for service in ("scheduler", "kvstore", "worker"):
            stack.wait_started(service)
        api = start_api(tmp_path, stack, cluster)
        started = time.monotonic()
        baseline = run_clients(api)
        fault_free_s = time.monotonic() - started
        assert all(finish in ("length", "stop") and text for text, finish in baseline), baseline
        outage: dict[str, float] = {}
        probe = sync_client(cluster.url, socket_timeout=1, socket_connect_timeout=1)

        def kill_master():
            killed_at = time.monotonic()
            cluster.procs["master"].kill()
            cluster.procs["master"].wait()

            def writable():
                try:
                    return probe.set(f"{stack.keys.prefix}:probe", "1")
                except (redis.RedisError, OSError):
                    return False

            wait_for(writable, 60, "the promoted replica to accept writes", interval=0.05)
            outage["s"] = time.monotonic() - killed_at

        started = time.monotonic()
        kv_before = stack.stats("kvstore") or {}
        results = run_clients(api, during=kill_master)
        took = time.monotonic() - started
        lost = sum(r != b for r, b in zip(results, baseline, strict=True))
        print(f"\nsentinel failover under {NUM_REQUESTS} requests: {lost} lost, redis writable again after "
              f"{outage['s']:.2f} s, the {NUM_REQUESTS} requests took {took:.1f} s ({fault_free_s:.1f} s without fault)")
        assert lost == 0, [(r, b) for r, b in zip(results, baseline, strict=True) if r != b][:3]
        cluster.wait_for_every_sentinel_to_name(cluster.replica_port)
        stack.wait_kvstore_clean(timeout=60, since=kv_before)
        assert run_clients(api, count=4) == baseline[:4]  # sent after the failover: served
        assert all(proc.poll() is None for proc in stack.procs.values())
    finally:
        if api is not None:
            api.close()
        stack.close()
        cluster.close()
