"""The scheduler loop's per-api bookkeeping: one batch per api, duplicates dropped, finished forgotten."""

from __future__ import annotations

from pagedserve.services.scheduler.api_routes import ApiRoutes, final_delta, request_from_submit
from pagedserve.shared.messages import RequestDelta, SamplingParams, SubmitRequest


def test_deltas_are_grouped_per_api_and_finished_requests_forgotten():
    routes = ApiRoutes()
    routes.add("a1", "api-a")
    routes.add("b1", "api-b")
    routes.route(RequestDelta("a1", [5]))
    routes.route(RequestDelta("b1", [6], finish_reason="stop"))
    routes.route(RequestDelta("a1", [7]))
    batches = routes.take()
    assert {api: [d.new_token_ids for d in ds] for api, ds in batches.items()} == {"api-a": [[5], [7]],
                                                                                  "api-b": [[6]]}
    assert routes.take() == {}
    assert routes.api_ids() == ["api-a"] and routes.requests_of("api-b") == []
    assert routes.is_known("b1")  # a late duplicate of a finished request is still dropped


def test_only_the_most_recent_finished_ids_are_remembered():
    routes = ApiRoutes(remember_finished=2)
    for i in range(3):
        routes.add(f"r{i}", "api")
        routes.route(RequestDelta(f"r{i}", [], finish_reason="abort"))
    assert [routes.is_known(f"r{i}") for i in range(3)] == [False, True, True]


def test_a_resubmission_resumes_after_the_delivered_tokens():
    sub = SubmitRequest("r", "api", [1, 2, 3], SamplingParams(max_tokens=3), 0.0, output_token_ids=[9, 9, 9])
    request = request_from_submit(sub, [0])
    assert request.all_token_ids == [1, 2, 3, 9, 9, 9]
    assert request.stop_status(max_model_len=100).finish_reason == "length"
    delta = final_delta(request, "length")
    assert (delta.new_token_ids, delta.num_prompt_tokens, delta.num_output_tokens) == ([], 3, 3)
