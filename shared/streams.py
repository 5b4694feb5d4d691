"""Redis key and stream names, all under one configurable prefix.

Stacks and tests share one Redis by prefix. Payloads: codec msgpack under field b"m".
Flow (one message per step per hop):
  api        --SubmitRequest/AbortRequest--> requests          (group "scheduler")
  scheduler  --AllocRequest-->               kv_alloc          (group "kvstore")
  kvstore    --AllocReply-->                 kv_reply          (group "scheduler")
  scheduler  --StepPlan-->                   worker_plan(id)   (group "worker")
  worker     --StepResult-->                 worker_results    (group "scheduler")
  worker     --WorkerHello-->                worker_hello      (group "scheduler"; kvstore reads it too)
  scheduler  --DeltaBatch-->                 api_deltas(api_id)  (group "api")
Heartbeats are plain keys with a TTL; stats are msgpack blobs each service rewrites.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "pagedserve"
FIELD = b"m"
HEARTBEAT_TTL_S = 5.0
HEARTBEAT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # streams
    @property
    def requests(self) -> str:
        return self._k("requests")

    @property
    def kv_alloc(self) -> str:
        return self._k("kv", "alloc")

    @property
    def kv_reply(self) -> str:
        return self._k("kv", "reply")

    def worker_plan(self, worker_id: str) -> str:
        return self._k("worker", worker_id, "plan")

    @property
    def worker_results(self) -> str:
        return self._k("worker", "results")

    @property
    def worker_hello(self) -> str:
        return self._k("worker", "hello")

    def api_deltas(self, api_id: str) -> str:
        return self._k("api", api_id, "deltas")

    # heartbeats (SET key value PX ttl): service is "scheduler", "kvstore", "worker:<id>", "api:<id>"
    def heartbeat(self, service: str) -> str:
        return self._k("hb", service)

    def heartbeat_pattern(self, kind: str) -> str:
        return self._k("hb", kind) + ":*"

    # stats blobs (msgpack maps): "scheduler", "kvstore"
    def stats(self, service: str) -> str:
        return self._k("stats", service)

    # control: the kvstore answers admin commands (e.g. leak check) on this stream
    @property
    def control(self) -> str:
        return self._k("control")
