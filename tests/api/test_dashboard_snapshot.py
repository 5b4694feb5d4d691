"""build_snapshot: the dashboard's JSON from the stats blobs (pure)."""

from __future__ import annotations

import base64
import json

from pagedserve.services.api.dashboard_snapshot import build_snapshot


def test_snapshot_of_full_blobs():
    stats = {
        "scheduler": {"num_requests_running": 2, "num_requests_waiting": 5, "num_preemptions_total": 1,
                      "generation_tokens_total": 640, "prompt_tokens_total": 90, "num_finished_total": 3,
                      "policy": {"name": "sjf", "options": {"aging": 2}}, "admission": {"x": [1]},
                      "workers": {"1": {"num_requests_running": 2, "num_requests_waiting": 4, "num_preemptions_total": 1,
                                        "load_blocks": 9}}},
        "kvstore": {"num_blocks": 4, "num_held_blocks": 3, "num_free_blocks": 1, "num_cached_blocks": 2,
                    "num_cached_free_blocks": 0, "usage": 0.75, "prefix_caching": True, "prefix_cache_queries": 64,
                    "prefix_cache_hits": 16, "integrity_ok": True, "prefix_cache_reset_ids": ["a"]},
        "block_map": {"workers": {"1": {"num_blocks": 4, "block_size": 16, "states": bytes([0x81, 2, 1, 0])},
                                  "0": {"num_blocks": 2, "block_size": 16, "states": b"\x00\x80"}}},
    }
    snap = build_snapshot(stats, ttft_sum=1.5, ttft_count=3.0, policies=["fcfs", "sjf"], now=100.0, missing=[])
    assert snap == {
        "time": 100.0,
        "missing": [],
        "scheduler": {"num_requests_running": 2, "num_requests_waiting": 5, "num_preemptions_total": 1,
                      "generation_tokens_total": 640, "prompt_tokens_total": 90, "num_finished_total": 3,
                      "spec_decode_num_drafts_total": None, "spec_decode_num_draft_tokens_total": None,
                      "spec_decode_num_accepted_tokens_total": None},
        "kvstore": {"num_blocks": 4, "num_held_blocks": 3, "num_free_blocks": 1, "num_cached_blocks": 2,
                    "num_cached_free_blocks": 0, "usage": 0.75, "prefix_caching": True, "prefix_cache_queries": 64,
                    "prefix_cache_hits": 16, "integrity_ok": True, "prefix_cache_tier_hits": None,
                    "tier_num_blocks": None, "tier_usage": None, "tier_capacity_bytes": None},
        "policy": {"name": "sjf", "options": {"aging": 2}},
        "policies": ["fcfs", "sjf"],
        "ttft": {"sum": 1.5, "count": 3.0},
        "workers": {"0": {"num_blocks": 2, "block_size": 16, "states": base64.b64encode(b"\x00\x80").decode(),
                          "num_requests_running": None, "num_requests_waiting": None, "num_preemptions_total": None},
                    "1": {"num_blocks": 4, "block_size": 16, "states": base64.b64encode(b"\x81\x02\x01\x00").decode(),
                          "num_requests_running": 2, "num_requests_waiting": 4, "num_preemptions_total": 1}},
    }
    assert list(snap["workers"]) == ["0", "1"]
    json.dumps(snap)  # JSON-able as the SSE route sends it


def test_snapshot_before_any_service_reported():
    snap = build_snapshot({"scheduler": {}, "kvstore": {}, "block_map": {}}, 0.0, 0.0, [], now=1.0,
                          missing=["kvstore", "worker"])
    assert snap["policy"] is None and snap["workers"] == {} and snap["missing"] == ["kvstore", "worker"]
    assert set(snap["scheduler"].values()) == {None} and set(snap["kvstore"].values()) == {None}
    bad = build_snapshot({"block_map": {"workers": {"0": {"states": "not bytes"}, "1": 7}}}, 0.0, 0.0, [], 1.0)
    assert bad["workers"] == {}
