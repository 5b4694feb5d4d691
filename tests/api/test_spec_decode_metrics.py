"""Speculative decoding's Prometheus series (vLLM's spec_decode_* names) from the scheduler's stats blob."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.services.api.metrics import ApiMetrics


def _samples(sched: dict) -> dict:
    text = ApiMetrics().render({"scheduler": sched}).decode()
    return {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "spec_decode" in s.name}


def test_drafts_draft_tokens_accepted_and_acceptance_per_position():
    sched = {"spec_decode_num_drafts_total": 10, "spec_decode_num_draft_tokens_total": 38,
             "spec_decode_num_accepted_tokens_total": 21, "spec_decode_num_accepted_tokens_per_pos_0_total": 9,
             "spec_decode_num_accepted_tokens_per_pos_1_total": 7, "spec_decode_num_accepted_tokens_per_pos_2_total": 5}
    assert _samples(sched) == {
        ("pagedserve:spec_decode_num_drafts_total", None): 10,
        ("pagedserve:spec_decode_num_draft_tokens_total", None): 38,
        ("pagedserve:spec_decode_num_accepted_tokens_total", None): 21,
        ("pagedserve:spec_decode_num_accepted_tokens_per_pos_total", "0"): 9,
        ("pagedserve:spec_decode_num_accepted_tokens_per_pos_total", "1"): 7,
        ("pagedserve:spec_decode_num_accepted_tokens_per_pos_total", "2"): 5,
    }


def test_speculation_off_shows_zero_counters_and_no_positions():
    assert _samples({}) == {("pagedserve:spec_decode_num_drafts_total", None): 0,
                            ("pagedserve:spec_decode_num_draft_tokens_total", None): 0,
                            ("pagedserve:spec_decode_num_accepted_tokens_total", None): 0}


def test_the_dashboard_snapshot_carries_the_spec_decode_counters():
    from pagedserve.services.api.dashboard_snapshot import build_snapshot

    sched = {"spec_decode_num_drafts_total": 4, "spec_decode_num_draft_tokens_total": 16,
             "spec_decode_num_accepted_tokens_total": 10}
    snapshot = build_snapshot({"scheduler": sched}, 0.0, 0.0, [], 1.0)
    assert {k: snapshot["scheduler"][k] for k in sched} == sched
