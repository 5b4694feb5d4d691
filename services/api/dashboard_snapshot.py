"""What the dashboard shows, as one JSON-able map built from the stats blobs: pure, no Redis.

Counters are running totals (the page differences two snapshots); block maps are base64, one byte a block.
"""

from __future__ import annotations

import base64

SCHEDULER_FIELDS = ("num_requests_running", "num_requests_waiting", "num_preemptions_total",
                    "generation_tokens_total", "prompt_tokens_total", "num_finished_total",
                    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                    "spec_decode_num_accepted_tokens_total")
WORKER_FIELDS = ("num_requests_running", "num_requests_waiting", "num_preemptions_total")
KVSTORE_FIELDS = ("num_blocks", "num_held_blocks", "num_free_blocks", "num_cached_blocks", "num_cached_free_blocks",
                  "usage", "prefix_caching", "prefix_cache_queries", "prefix_cache_hits", "integrity_ok",
                  "prefix_cache_tier_hits", "tier_num_blocks", "tier_usage", "tier_capacity_bytes")


def _plain(value):
    return value if isinstance(value, (int, float, bool, str)) or value is None else None


def build_snapshot(stats: dict[str, dict], ttft_sum: float, ttft_count: float, policies: list[str],
                   now: float, missing: list[str] = ()) -> dict:
    """stats: {"scheduler": {...}, "kvstore": {...}, "block_map": {"workers": {id: {...}}}};
    missing: the services /ready waits for (empty: ready)."""
    sched, kv = stats.get("scheduler", {}), stats.get("kvstore", {})
    lanes = sched.get("workers") if isinstance(sched.get("workers"), dict) else {}
    workers = {}
    for worker_id, entry in sorted((stats.get("block_map", {}).get("workers") or {}).items()):
        states = entry.get("states") if isinstance(entry, dict) else None
        if isinstance(states, bytes):
            lane = lanes.get(str(worker_id)) if isinstance(lanes.get(str(worker_id)), dict) else {}
            workers[str(worker_id)] = {"num_blocks": len(states), "block_size": _plain(entry.get("block_size")),
                                       "states": base64.b64encode(states).decode("ascii"),
                                       **{key: _plain(lane.get(key)) for key in WORKER_FIELDS}}
    policy = sched.get("policy")
    return {
        "time": now,
        "missing": list(missing),
        "scheduler": {key: _plain(sched.get(key)) for key in SCHEDULER_FIELDS},
        "kvstore": {key: _plain(kv.get(key)) for key in KVSTORE_FIELDS},
        "policy": policy if isinstance(policy, dict) else None,
        "policies": policies,
        "ttft": {"sum": ttft_sum, "count": ttft_count},
        "workers": workers,
    }
