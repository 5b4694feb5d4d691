"""The offload tier's Prometheus series (services/api/metrics.py) from the stats blobs."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.services.api.metrics import ApiMetrics


def test_the_tier_is_seen_beside_the_pools():
    kv = {"prefix_cache_hits": 300, "prefix_cache_tier_hits": 200, "tier_usage": 0.25, "tier_used_bytes": 1024,
          "tier_num_blocks": 4, "tier_num_evicted": 2, "tier_num_pending": 3, "tier_num_cancelled": 5,
          "tier_num_swept": 6}
    sched = {"num_tier_loaded_blocks_total": 12, "tier_loaded_bytes_total": 3072, "tier_load_seconds_total": 0.5,
             "num_tier_missed_blocks_total": 1, "num_tier_stored_blocks_total": 7, "tier_stored_bytes_total": 1792,
             "tier_store_seconds_total": 0.25, "num_resumed_total": 2, "num_resumed_recomputed_tokens_total": 9,
             "num_resumed_over_one_block_total": 1}
    text = ApiMetrics().render({"kvstore": kv, "scheduler": sched}).decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert {name: values["pagedserve:" + name] for name in (
        "prefix_cache_hits_total", "prefix_cache_offload_hits_total", "kv_offload_loaded_blocks_total",
        "kv_offload_loaded_bytes_total", "kv_offload_load_seconds_total", "kv_offload_missed_blocks_total",
        "kv_offload_stored_blocks_total", "kv_offload_stored_bytes_total", "kv_offload_store_seconds_total",
        "kv_offload_evictions_total", "resumed_requests_total", "resumed_recomputed_tokens_total",
        "resumed_over_one_block_total", "kv_offload_usage_perc", "kv_offload_used_bytes", "kv_offload_blocks",
        "kv_offload_pending_blocks", "kv_offload_cancelled_blocks_total", "kv_offload_swept_blocks_total")} == {
        "prefix_cache_hits_total": 300, "prefix_cache_offload_hits_total": 200, "kv_offload_loaded_blocks_total": 12,
        "kv_offload_loaded_bytes_total": 3072, "kv_offload_load_seconds_total": 0.5,
        "kv_offload_missed_blocks_total": 1, "kv_offload_stored_blocks_total": 7,
        "kv_offload_stored_bytes_total": 1792, "kv_offload_store_seconds_total": 0.25,
        "kv_offload_evictions_total": 2, "resumed_requests_total": 2, "resumed_recomputed_tokens_total": 9,
        "resumed_over_one_block_total": 1, "kv_offload_usage_perc": 0.25, "kv_offload_used_bytes": 1024, "kv_offload_blocks": 4,
        "kv_offload_pending_blocks": 3, "kv_offload_cancelled_blocks_total": 5, "kv_offload_swept_blocks_total": 6}
