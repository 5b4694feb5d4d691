"""Per-worker Prometheus samples (services/api/metrics.py): each per-worker series carries
worker="<id>" beside its unlabelled total, taken from the scheduler's and the kvstore's
stats blobs."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.services.api.metrics import ApiMetrics

SNAPSHOT = {
    "scheduler": {"num_requests_running": 3, "num_requests_waiting": 1, "generation_tokens_total": 10,
                  "workers": {"a": {"num_requests_running": 1, "num_requests_waiting": 1, "generation_tokens_total": 4},
                              "b": {"num_requests_running": 2, "num_requests_waiting": 0, "generation_tokens_total": 6}}},
    "kvstore": {"num_blocks": 20, "num_held_blocks": 5, "prefix_cache_queries": 9, "prefix_cache_hits": 7,
                "workers": {"a": {"num_blocks": 10, "num_held_blocks": 1, "prefix_cache_queries": 4,
                                  "prefix_cache_hits": 3},
                            "b": {"num_blocks": 10, "num_held_blocks": 4, "prefix_cache_queries": 5,
                                  "prefix_cache_hits": 4}}},
}


def samples(snapshot: dict) -> dict[str, dict[str, float]]:
    """family -> {worker id, or "" for the unlabelled total: value}."""
    text = ApiMetrics().render(snapshot).decode()
    return {f.name: {s.labels.get("worker", ""): s.value for s in f.samples} for f in text_string_to_metric_families(text)}


def test_every_per_worker_series_has_a_labelled_sample_per_worker_and_the_total():
    got = samples(SNAPSHOT)
    assert got["pagedserve:generation_tokens"] == {"": 10.0, "a": 4.0, "b": 6.0}
    assert got["pagedserve:num_requests_running"] == {"": 3.0, "a": 1.0, "b": 2.0}
    assert got["pagedserve:num_requests_waiting"] == {"": 1.0, "a": 1.0, "b": 0.0}
    assert got["pagedserve:kv_cache_usage_perc"] == {"": 0.25, "a": 0.1, "b": 0.4}
    assert got["pagedserve:prefix_cache_queries"] == {"": 9.0, "a": 4.0, "b": 5.0}
    assert got["pagedserve:prefix_cache_hits"] == {"": 7.0, "a": 3.0, "b": 4.0}
    assert got["pagedserve:prompt_tokens"] == {"": 0.0}  # not a per-worker series


def test_no_workers_in_the_blobs_gives_only_the_totals():
    got = samples({"scheduler": {"generation_tokens_total": 2, "workers": "garbage"}, "kvstore": {}})
    assert got["pagedserve:generation_tokens"] == {"": 2.0}
    assert got["pagedserve:kv_cache_usage_perc"] == {"": 0.0}
