"""Metrics that add up (services/api/metrics.py): every engine series carries a `worker` label,
and no family holds a total beside its parts, so sum() over a family is the stack's total: one
series per worker, "departed"/"unplaced" for what no live worker holds, "all" where the stats
blobs keep no per-worker value."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.services.api.metrics import ApiMetrics

SNAPSHOT = {
    "scheduler": {"num_requests_running": 3, "num_requests_waiting": 2, "generation_tokens_total": 12,
                  "prompt_tokens_total": 40,
                  "workers": {"a": {"num_requests_running": 1, "num_requests_waiting": 1, "generation_tokens_total": 4},
                              "b": {"num_requests_running": 2, "num_requests_waiting": 0, "generation_tokens_total": 6}}},
    "kvstore": {"num_blocks": 20, "num_held_blocks": 5, "prefix_cache_queries": 9, "prefix_cache_hits": 7,
                "workers": {"a": {"num_blocks": 10, "num_held_blocks": 1, "prefix_cache_queries": 4,
                                  "prefix_cache_hits": 3},
                            "b": {"num_blocks": 10, "num_held_blocks": 4, "prefix_cache_queries": 5,
                                  "prefix_cache_hits": 4}}},
}
# family -> (blob, key of the stack's total in it and in each worker's blob)
ADDITIVE = {
    "pagedserve:num_requests_running": ("scheduler", "num_requests_running"),
    "pagedserve:num_requests_waiting": ("scheduler", "num_requests_waiting"),
    "pagedserve:generation_tokens": ("scheduler", "generation_tokens_total"),
    "pagedserve:prompt_tokens": ("scheduler", "prompt_tokens_total"),
    "pagedserve:prompt_tokens_computed": ("scheduler", "prompt_tokens_computed_total"),
    "pagedserve:num_preemptions": ("scheduler", "num_preemptions_total"),
    "pagedserve:prefix_cache_queries": ("kvstore", "prefix_cache_queries"),
    "pagedserve:prefix_cache_hits": ("kvstore", "prefix_cache_hits"),
    "pagedserve:kv_cache_evictions": ("kvstore", "num_evictions"),
    "pagedserve:kv_cache_cached_free_blocks": ("kvstore", "num_cached_free_blocks"),
}

EXACT = {"num_requests_running", "num_cached_free_blocks"}  # gauges only live workers hold


def samples(snapshot: dict) -> dict[str, dict[str, float]]:
    """family -> {its worker label: value}; a sample without the label fails here."""
    text = ApiMetrics().render(snapshot).decode()
    families = {}
    for f in text_string_to_metric_families(text):
        if f.name.startswith("pagedserve:") and f.type in ("gauge", "counter") and f.name in ADDITIVE | {
                "pagedserve:kv_cache_usage_perc": ()}:
            assert all("worker" in s.labels for s in f.samples), f.samples
            families[f.name] = {s.labels["worker"]: s.value for s in f.samples}
    return families


def test_each_worker_one_series_and_no_total_beside_them():
    got = samples(SNAPSHOT)
    assert got["pagedserve:generation_tokens"] == {"a": 4.0, "b": 6.0, "departed": 2.0}
    assert got["pagedserve:num_requests_running"] == {"a": 1.0, "b": 2.0}
    assert got["pagedserve:num_requests_waiting"] == {"a": 1.0, "b": 0.0, "unplaced": 1.0}
    assert got["pagedserve:kv_cache_usage_perc"] == {"a": 0.1, "b": 0.4}
    assert got["pagedserve:prefix_cache_queries"] == {"a": 4.0, "b": 5.0}
    assert got["pagedserve:prefix_cache_hits"] == {"a": 3.0, "b": 4.0}
    assert got["pagedserve:prompt_tokens"] == {"all": 40.0}  # the blobs keep no per-worker value


def test_no_workers_in_the_blobs_gives_one_series_labelled_all():
    got = samples({"scheduler": {"generation_tokens_total": 2, "workers": "garbage"}, "kvstore": {}})
    assert got["pagedserve:generation_tokens"] == {"all": 2.0}
    assert got["pagedserve:kv_cache_usage_perc"] == {"all": 0.0}


@st.composite
def snapshots(draw):
    """A stack's blobs: per-worker values, and totals that are their sum plus, for counters and
    waiting requests, what no live worker holds (departed workers' counts, unplaced requests)."""
    ids = draw(st.lists(st.sampled_from("abcdef"), unique=True, max_size=4))
    blobs = {}
    for blob in ("scheduler", "kvstore"):
        keys = [key for b, key in ADDITIVE.values() if b == blob]
        workers = {w: {k: draw(st.integers(0, 10**6)) for k in keys} for w in ids}
        totals = {k: sum(w[k] for w in workers.values()) + (0 if k in EXACT else draw(st.integers(0, 10**6)))
                  for k in keys}
        blobs[blob] = {**totals, "workers": workers}
    return blobs


@given(snapshots())
def test_sum_over_every_family_is_the_stacks_total(snapshot):
    got = samples(snapshot)
    for family, (blob, key) in ADDITIVE.items():
        series = got[family]
        assert sum(series.values()) == snapshot[blob][key], family
        assert "all" not in series or len(series) == 1  # never a total beside per-worker series
        assert set(snapshot[blob]["workers"]) <= set(series)
