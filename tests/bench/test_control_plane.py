"""The control-plane bench: a simulated worker answers plans as a real one does (a token once a
request reaches the end of its known tokens), and the bench runs the real scheduler, kvstore and
a redis-server of its own against simulated workers."""

from __future__ import annotations

import argparse

import pytest

from pagedserve.services.bench.control_plane import add_arguments, measure
from pagedserve.services.bench.sim_worker import SimWorker, Window
from pagedserve.shared.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from pagedserve.shared.streams import Keys
from tests.cli.helpers import free_port


def _worker() -> SimWorker:
    return SimWorker(None, Keys("t"), "w", 0.0, 64, 16, Window(0.0, float("inf")))


def _new(request_id: str, prompt: int, scheduled: int, computed: int = 0) -> NewRequestData:
    return NewRequestData(request_id, list(range(10, 10 + prompt)), [0, 1], computed, scheduled, SamplingParams())


def test_a_token_only_when_a_request_reaches_its_known_end():
    worker = _worker()
    first = worker.execute(StepPlan(1, new_requests=[_new("a", 20, 16), _new("b", 4, 4)]))
    assert [s.request_id for s in first.sampled] == ["b"]  # a's prefill has 4 tokens to go
    second = worker.execute(StepPlan(2, cached_requests=[CachedRequestData("a", [], 16, 4),
                                                          CachedRequestData("b", [], 4, 1)]))
    assert [s.request_id for s in second.sampled] == ["a", "b"]
    assert worker.known == {"a": 21, "b": 6}
    third = worker.execute(StepPlan(3, cached_requests=[CachedRequestData("b", [], 5, 1)], finished_request_ids=["a"]))
    assert [s.request_id for s in third.sampled] == ["b"] and worker.known == {"b": 7}
    assert all(10 <= s.token_id < 1010 for s in first.sampled + second.sampled + third.sampled)
    assert (worker.window.steps, worker.window.placements, worker.window.tokens) == (3, 2, 4)
    assert worker.execute(StepPlan(4, reset=True)).sampled == [] and worker.known == {}


def test_an_unknown_request_in_the_diff_gets_no_token():
    assert _worker().execute(StepPlan(1, cached_requests=[CachedRequestData("x", [], 3, 1)])).sampled == []


@pytest.mark.slow
def test_the_bench_drives_the_real_control_plane():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--warmup", "2", "--duration", "4", "--port", str(free_port()), "--procs", "1"])
    row = measure(args, 2)
    assert row["workers"] == 2 and row["in_flight"] == 8
    assert 0 < row["steps_per_s"] <= row["ideal_steps_per_s"] * 1.05
    assert row["tokens_per_s"] > 0 and row["routing_per_s"] > 0
    for key in ("scheduler_cpu", "kvstore_cpu", "redis_cpu", "redis_memory_mib", "scheduler_ms_per_step"):
        assert row[key] >= 0, key
