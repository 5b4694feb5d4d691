"""Prometheus metrics under the `pagedserve:` prefix, with vLLM's meanings.

Engine numbers come from the stats blobs at scrape time, latencies from this api. Per-worker
series (label worker="<id>") sit beside the unlabelled total: sum one or the other, never both.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.samples import Sample

PREFIX = "pagedserve:"
disable_created_metrics()  # no *_created series: they only add noise to every scrape
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


def _number(blob: dict, key: str) -> float:
    value = blob.get(key, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


class StatsCollector:
    """Gauges and counters taken from the stats blobs ({"scheduler": {...}, "kvstore": {...}})."""

    def __init__(self) -> None:
        self.snapshot: dict[str, dict] = {}

    def collect(self):
        sched = self.snapshot.get("scheduler", {})
        kv = self.snapshot.get("kvstore", {})
        sched_workers, kv_workers = _workers(sched), _workers(kv)
        yield _per_worker(GaugeMetricFamily(PREFIX + "num_requests_running", "Requests running (prefill or decode).",
                                            value=_number(sched, "num_requests_running")),
                          sched_workers, lambda w: _number(w, "num_requests_running"))
        yield _per_worker(GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
                                            value=_number(sched, "num_requests_waiting")),
                          sched_workers, lambda w: _number(w, "num_requests_waiting"))
        yield _per_worker(GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                            "KV cache usage: fraction of blocks held by requests (1 = full, 0 idle).",
                                            value=kv_usage(kv)), kv_workers, kv_usage)
        yield GaugeMetricFamily(PREFIX + "kv_cache_cached_free_blocks",
                                "Blocks nobody holds that still cache a prefix (evicted least recently freed first).",
                                value=_number(kv, "num_cached_free_blocks"))
        counters = (
            ("prefix_cache_queries", "Prefix cache queries, in tokens.", kv, "prefix_cache_queries"),
            ("prefix_cache_hits", "Prefix cache hits, in tokens.", kv, "prefix_cache_hits"),
            ("prompt_tokens", "Prompt tokens processed.", sched, "prompt_tokens_total"),
            ("prompt_tokens_computed", "Prompt tokens computed (not prefix-cache hits; recomputes count).", sched,
             "prompt_tokens_computed_total"),
            ("kv_cache_evictions", "Cached free blocks reused for another prefix.", kv, "num_evictions"),
            ("kv_block_copies", "Copy-on-write block copies (n > 1 forks).", kv, "num_block_copies"),
            ("prefix_cache_resets", "Prefix cache resets (POST /admin/prefix-cache/reset).", kv,
             "num_prefix_cache_resets"),
            ("generation_tokens", "Generation tokens produced.", sched, "generation_tokens_total"),
            ("num_preemptions", "Cumulative preemptions.", sched, "num_preemptions_total"),
        )
        per_worker = {"prefix_cache_queries": kv_workers, "prefix_cache_hits": kv_workers,
                      "generation_tokens": sched_workers}
        for name, doc, blob, key in counters:
            family = CounterMetricFamily(PREFIX + name, doc, value=_number(blob, key))
            yield _per_worker(family, per_worker.get(name, {}), lambda w, key=key: _number(w, key))


def _workers(blob: dict) -> dict[str, dict]:
    workers = blob.get("workers")
    return {str(k): v for k, v in workers.items() if isinstance(v, dict)} if isinstance(workers, dict) else {}


def _per_worker(family, workers: dict[str, dict], value_of):
    """family plus one sample labelled worker="<id>" per worker (beside its unlabelled total)."""
    name = family.name + ("_total" if family.type == "counter" else "")
    for worker_id, blob in sorted(workers.items()):
        family.samples.append(Sample(name, {"worker": worker_id}, value_of(blob)))
    return family


def kv_usage(kv: dict) -> float:
    """Fraction of blocks held by requests: num_held_blocks / num_blocks, else the blob's usage."""
    num_blocks = _number(kv, "num_blocks")
    if num_blocks > 0 and "num_held_blocks" in kv:
        return _number(kv, "num_held_blocks") / num_blocks
    return _number(kv, "usage")


class ApiMetrics:
    """One registry per app, so several apps in one process do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stats = StatsCollector()
        self.registry.register(self.stats)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival at the api to the first token.",
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive tokens of a request.",
            buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival at the api to the request's end.",
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.request_success = Counter(
            PREFIX + "request_success", "Requests finished, by finish reason.", ["finished_reason"],
            registry=self.registry)
        self.rejected = Counter(PREFIX + "api_rejected_requests", "Requests rejected at the api, by status.",
                                ["status"], registry=self.registry)

    def render(self, snapshot: dict[str, dict]) -> bytes:
        self.stats.snapshot = snapshot
        return generate_latest(self.registry)
