"""The benchmark summaries: percentiles and the throughput fields, exactly."""

from __future__ import annotations

import math

from pagedserve.services.bench.report import latency_summary, percentile, throughput_fields
from pagedserve.services.bench.serve import peak_kv_usage, summarize, totals
from pagedserve.services.bench.serve_client import RequestRecord


def test_percentile_interpolates_linearly():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_latency_summary_in_milliseconds():
    assert latency_summary("ttft", [0.1, 0.3]) == {"ttft_mean_ms": 200.0, "ttft_p50_ms": 200.0,
                                                   "ttft_p90_ms": 280.0, "ttft_p99_ms": 298.0}


def test_throughput_fields():
    assert throughput_fields(2.0, 4, 100, 300) == {"wall_s": 2.0, "num_requests": 4, "output_tokens": 100,
                                                   "prompt_tokens": 300, "output_tok_s": 50.0,
                                                   "total_tok_s": 200.0, "request_s": 2.0}


def test_summarize_counts_failures_and_prefix_hits():
    records = [RequestRecord(ok=True, num_prompt_tokens=10, num_output_tokens=3, ttft_s=0.5, e2e_s=1.5,
                             itl_s=[0.5, 0.5]),
               RequestRecord(ok=False, error="HTTP 429")]
    before = {"pagedserve:prefix_cache_queries_total": 100.0, "pagedserve:prefix_cache_hits_total": 10.0}
    after = {"pagedserve:prefix_cache_queries_total": 300.0, "pagedserve:prefix_cache_hits_total": 110.0}
    result = summarize("x", records, 2.0, 0.25, before, after)
    assert result["num_failed"] == 1 and result["first_error"] == "HTTP 429"
    assert result["output_tokens"] == 3 and result["num_requests"] == 1
    assert result["tpot_p50_ms"] == 500.0
    assert result["prefix_hit_rate"] == 0.5
    assert result["peak_kv_usage"] == 0.25


SCRAPE = """# TYPE pagedserve:kv_cache_usage_perc gauge
pagedserve:kv_cache_usage_perc{worker="w0"} 0.125
pagedserve:kv_cache_usage_perc{worker="w1"} 0.5
# TYPE pagedserve:prefix_cache_hits counter
pagedserve:prefix_cache_hits_total{worker="w0"} 3.0
pagedserve:prefix_cache_hits_total{worker="w1"} 4.0
pagedserve:prefix_cache_hits_total{worker="departed"} 5.0
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 9.0
"""


def test_metrics_read_per_worker_series():
    """Every engine series is labelled by worker: a counter's total sums them, KV usage is the fullest worker's."""
    assert totals(SCRAPE) == {"pagedserve:kv_cache_usage_perc": 0.625, "pagedserve:prefix_cache_hits_total": 12.0}
    assert peak_kv_usage(SCRAPE) == 0.5
    assert peak_kv_usage("process_cpu_seconds_total 9.0\n") is None
