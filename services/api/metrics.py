"""Prometheus metrics under the `pagedserve:` prefix, with vLLM's meanings.

Engine numbers come from the stats blobs at scrape time, latencies from this api. Every engine
series carries a `worker` label and no family holds a total beside its parts, so `sum()` over a
family is the stack's total: worker="<id>" per worker, worker="departed" for what workers that
left counted, worker="unplaced" for waiting requests not yet given a worker, worker="all" where
the blobs keep no per-worker value. kv_cache_usage_perc is a ratio: avg() or max() it.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pagedserve.shared.speculative_config import PER_POS_KEY

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


class LatencyHistogram:
    """A histogram observed without prometheus_client's lock (a bisect and two adds; the api observes once
    per token of every stream), registered as one series api=<id>. Only the event loop's thread observes."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], api_id: str, registry) -> None:
        self.name, self.documentation, self.api_id = name, documentation, api_id
        self.bounds = tuple(float(b) for b in buckets)
        self._labels = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.counts = [0] * (len(self.bounds) + 1)  # counts[i]: bounds[i-1] < value <= bounds[i]
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def collect(self):
        counts, total, cumulative = list(self.counts), self.sum, 0  # a copy: buckets and count agree
        buckets = []
        for label, count in zip(self._labels, counts, strict=True):
            cumulative += count
            buckets.append((label, cumulative))
        family = HistogramMetricFamily(self.name, self.documentation, labels=["api"])
        family.add_metric([self.api_id], buckets, sum_value=total)
        yield family


class StatsCollector:
    """Gauges and counters taken from the stats blobs ({"scheduler": {...}, "kvstore": {...}})."""

    def __init__(self) -> None:
        self.snapshot: dict[str, dict] = {}

    def collect(self):
        sched = self.snapshot.get("scheduler", {})
        kv = self.snapshot.get("kvstore", {})
        sched_workers, kv_workers = _workers(sched), _workers(kv)
        yield _per_worker(GaugeMetricFamily(PREFIX + "num_requests_running", "Requests running (prefill or decode).",
                                            labels=["worker"]),
                          _number(sched, "num_requests_running"), sched_workers, "num_requests_running")
        yield _per_worker(GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
                                            labels=["worker"]),
                          _number(sched, "num_requests_waiting"), sched_workers, "num_requests_waiting", "unplaced")
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                  "KV cache usage: fraction of blocks held by requests (1 = full, 0 idle).",
                                  labels=["worker"])
        for worker_id, blob in sorted(kv_workers.items()) or [("all", kv)]:
            usage.add_metric([worker_id], kv_usage(blob))
        yield usage
        yield _per_worker(GaugeMetricFamily(PREFIX + "kv_cache_cached_free_blocks", "Blocks nobody holds that still "
                                            "cache a prefix (evicted least recently freed first).", labels=["worker"]),
                          _number(kv, "num_cached_free_blocks"), kv_workers, "num_cached_free_blocks")
        for name, doc, key in (("kv_offload_usage_perc", "KV offload tier usage: bytes held / its budget.", "tier_usage"),
                               ("kv_offload_used_bytes", "Bytes of KV blocks the offload tier holds.", "tier_used_bytes"),
                               ("kv_offload_blocks", "KV blocks the offload tier holds.", "tier_num_blocks"),
                               ("kv_offload_pending_blocks", "Offload tier stores planned, not yet written.",
                                "tier_num_pending")):
            yield GaugeMetricFamily(PREFIX + name, doc, value=_number(kv, key))
        counters = (  # name, doc, blob, key in the blob and in its per-worker blobs
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
            ("prefix_cache_offload_hits", "Prefix cache hits from the KV offload tier, in tokens (part of "
             "prefix_cache_hits; the rest are the worker pool's).", kv, "prefix_cache_tier_hits"),
            ("kv_offload_loaded_blocks", "Blocks loaded from the offload tier into a pool.", sched,
             "num_tier_loaded_blocks_total"),
            ("kv_offload_loaded_bytes", "Bytes loaded from the offload tier.", sched, "tier_loaded_bytes_total"),
            ("kv_offload_load_seconds", "Seconds workers waited on offload tier loads.", sched,
             "tier_load_seconds_total"),
            ("kv_offload_missed_blocks", "Planned offload tier loads that failed: computed instead.", sched,
             "num_tier_missed_blocks_total"),
            ("kv_offload_stored_blocks", "Blocks written to the offload tier.", sched, "num_tier_stored_blocks_total"),
            ("kv_offload_stored_bytes", "Bytes written to the offload tier.", sched, "tier_stored_bytes_total"),
            ("kv_offload_store_seconds", "Seconds of offload tier writes (off the step's path).", sched,
             "tier_store_seconds_total"),
            ("kv_offload_evictions", "Offload tier blocks evicted for room (LRU).", kv, "tier_num_evicted"),
            ("kv_offload_cancelled_blocks", "Offload tier stores dropped unwritten (refused, late or orphaned).",
             kv, "tier_num_cancelled"),
            ("kv_offload_swept_blocks", "Orphaned offload tier writes (no reservation, no confirmation) the "
             "kvstore's sweep deleted.", kv, "tier_num_swept"),
            ("resumed_requests", "Preempted or moved requests admitted again.", sched, "num_resumed_total"),
            ("resumed_recomputed_tokens", "Known tokens resumed requests computed again (neither tier had "
             "them).", sched, "num_resumed_recomputed_tokens_total"),
            ("resumed_over_one_block", "Resumes that computed more than one block of known tokens again.", sched,
             "num_resumed_over_one_block_total"),
            ("spec_decode_num_drafts", "Speculative decoding: request steps that verified drafts.", sched,
             "spec_decode_num_drafts_total"),
            ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", sched,
             "spec_decode_num_draft_tokens_total"),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.", sched,
             "spec_decode_num_accepted_tokens_total"),
        )
        for name, doc, blob, key in counters:
            workers = sched_workers if blob is sched else kv_workers
            family = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
            yield _per_worker(family, _number(blob, key), workers, key, "departed")
        yield _accepted_per_pos(sched)
        restarts = self.snapshot.get("launcher", {}).get("restarts", {})  # only under `pagedserve up`
        family = CounterMetricFamily(PREFIX + "service_restarts", "Children restarted by `pagedserve up`.",
                                     labels=["service"])
        for service, count in sorted(restarts.items() if isinstance(restarts, dict) else ()):
            family.add_metric([str(service)], float(count) if isinstance(count, int) else 0.0)
        yield family


def _accepted_per_pos(sched: dict) -> CounterMetricFamily:
    """vLLM's spec_decode_num_accepted_tokens_per_pos: accepted drafts at each draft position (0 first)."""
    family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                 "Speculative decoding: draft tokens accepted at each position.",
                                 labels=["worker", "position"])
    positions = sorted(int(key[len(PER_POS_KEY):-len("_total")]) for key in sched
                       if key.startswith(PER_POS_KEY) and key[len(PER_POS_KEY):-len("_total")].isdigit())
    for pos in positions:
        family.add_metric(["all", str(pos)], _number(sched, f"{PER_POS_KEY}{pos}_total"))
    return family


def _workers(blob: dict) -> dict[str, dict]:
    workers = blob.get("workers")
    return {str(k): v for k, v in workers.items() if isinstance(v, dict)} if isinstance(workers, dict) else {}


def _per_worker(family, total: float, workers: dict[str, dict], key: str, rest: str | None = None):
    """family with one sample per worker that reports `key` (worker="<id>"), and `rest` for the
    part of `total` no worker's sample holds, when positive; worker="all" with the total where no
    worker reports `key`. Its samples add up to `total`."""
    parts = {worker_id: _number(blob, key) for worker_id, blob in sorted(workers.items()) if key in blob}
    if not parts:
        family.add_metric(["all"], total)
        return family
    for worker_id, value in parts.items():
        family.add_metric([worker_id], value)
    remainder = total - sum(parts.values())
    if rest is not None and remainder > 0:
        family.add_metric([rest], remainder)
    return family


def kv_usage(kv: dict) -> float:
    """Fraction of blocks held by requests: num_held_blocks / num_blocks, else the blob's usage."""
    num_blocks = _number(kv, "num_blocks")
    if num_blocks > 0 and "num_held_blocks" in kv:
        return _number(kv, "num_held_blocks") / num_blocks
    return _number(kv, "usage")


class ApiMetrics:
    """One registry per app, so several apps in one process do not collide. The latencies this api
    measures carry api="<its id>", as engine series carry `worker`: replicas' series stay apart."""

    def __init__(self, api_id: str = "api") -> None:
        self.api_id = api_id
        self.registry = CollectorRegistry()
        self.stats = StatsCollector()
        self.registry.register(self.stats)
        self.time_to_first_token = LatencyHistogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival at the api to the first token.",
            _TTFT_BUCKETS, api_id, self.registry)
        self.inter_token_latency = LatencyHistogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive tokens of a request.",
            _ITL_BUCKETS, api_id, self.registry)
        self.e2e_request_latency = LatencyHistogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival at the api to the request's end.",
            _E2E_BUCKETS, api_id, self.registry)
        self.request_success = Counter(
            PREFIX + "request_success", "Requests finished, by finish reason.", ["finished_reason"],
            registry=self.registry)
        self.rejected = Counter(PREFIX + "api_rejected_requests", "Requests rejected at the api, by status.",
                                ["status"], registry=self.registry)

    def render(self, snapshot: dict[str, dict]) -> bytes:
        self.stats.snapshot = snapshot
        return generate_latest(self.registry)
