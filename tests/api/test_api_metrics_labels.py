"""The latencies an api measures carry api="<its id>" (as engine series carry `worker`), so two
replicas' histograms stay apart and sum by (le) over them is the stack's."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.services.api.metrics import ApiMetrics

LATENCIES = ("pagedserve:time_to_first_token_seconds", "pagedserve:inter_token_latency_seconds",
             "pagedserve:e2e_request_latency_seconds")


def _histograms(metrics: ApiMetrics) -> dict[str, list]:
    text = metrics.render({}).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name in LATENCIES}


def test_every_latency_sample_names_its_api():
    metrics = ApiMetrics("api-7")
    metrics.time_to_first_token.observe(0.03)
    metrics.inter_token_latency.observe(0.02)
    metrics.inter_token_latency.observe(0.04)
    metrics.e2e_request_latency.observe(0.4)
    families = _histograms(metrics)
    assert set(families) == set(LATENCIES)
    for name, samples in families.items():
        assert {s.labels["api"] for s in samples} == {"api-7"}, name
    counts = {name: next(s.value for s in samples if s.name == name + "_count") for name, samples in families.items()}
    assert counts == dict(zip(LATENCIES, (1.0, 2.0, 1.0), strict=True))


def test_two_replicas_series_add_up():
    a, b = ApiMetrics("a"), ApiMetrics("b")
    a.time_to_first_token.observe(0.5)
    b.time_to_first_token.observe(0.25)
    b.time_to_first_token.observe(0.25)
    sums = [s for m in (a, b) for s in _histograms(m)[LATENCIES[0]] if s.name.endswith("_sum")]
    assert sorted((s.labels["api"], s.value) for s in sums) == [("a", 0.5), ("b", 0.5)]


def test_the_dashboard_reads_its_own_apis_ttft():
    from pagedserve.services.api.dashboard_routes import _ttft

    metrics = ApiMetrics("api-3")
    metrics.time_to_first_token.observe(0.5)
    metrics.time_to_first_token.observe(0.25)
    assert _ttft(metrics) == (0.75, 2.0)
