"""The msgpack codec (shared/codec.py): every message type round-trips exactly, fields are
checked against their types, and bad data is a CodecError, never another exception."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from pagedserve.shared import codec
from pagedserve.shared.messages import (
    VERSION,
    AllocCandidate,
    AllocReply,
    AllocRequest,
    AllocResult,
    CachedRequestData,
    CommandReply,
    DeltaBatch,
    Fork,
    NewRequestData,
    RequestDelta,
    SampledToken,
    SamplingParams,
    SetPolicy,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerHello,
)

SAMPLING = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=[2, 9], logprobs=2, n=2)
MESSAGES = [
    SAMPLING,
    AllocRequest(11, ["gone"], [AllocCandidate("a", 3, 40, True, [5, 6, 7], "salt"), AllocCandidate("b", 1, 9, False, [8] * 16, "", 16, [bytes(range(32))])],
                 [Fork("p", ["p.0", "p.1"])], reset=True),
    AllocReply(11, [AllocResult("a", "ok", [4, 8], 16), AllocResult("b", "preempted")]),
    StepPlan(12, [NewRequestData("a", [1, 2, 3], [0, 5], 0, 3, SAMPLING, 1)],
             [CachedRequestData("b", [], 40, 1), CachedRequestData("c", [77], 41, 1)], ["x"], [(3, 4)], False),
    StepResult(12, [SampledToken("a", 5), SampledToken("b", 6, -0.25, [(6, -0.25), (1, -3.5)])]),
    DeltaBatch(12, [RequestDelta("a", [5], None, 3, 1, 0), RequestDelta("b", [], "stop", 9, 4, 16,
                                                                         [SampledToken("b", 6, -0.5)])]),
    SubmitRequest("r", "api-1", [10, 11], SAMPLING, 1.5, priority=2, tenant=None, output_token_ids=[12]),
    SetPolicy("cmd", "api-1", "fair", {"weights": {"a": 2}}),
    CommandReply("cmd", True, {"name": "fair", "options": {}}),
    WorkerHello("0", 100, 16, "smollm2", 8192, [2]),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(message):
    assert codec.unpack(codec.pack(message), type(message)) == message


def test_the_wire_form_is_a_versioned_map_of_fields():
    data = msgpack.unpackb(codec.pack(CachedRequestData("b", [1, 2, 70000], 40, 1)), raw=False)
    assert data == {"v": VERSION, "t": "CachedRequestData", "d": {
        "request_id": "b", "new_block_ids": [1, 2, 70000], "num_computed_tokens": 40, "num_scheduled_tokens": 1,
        "draft_token_ids": [], "num_steps": 1}}


def test_numpy_scalars_are_written_as_numbers():
    import numpy as np

    token = codec.unpack(codec.pack(SampledToken("a", np.int64(7), np.float32(-0.5))))
    assert token == SampledToken("a", 7, -0.5) and type(token.token_id) is int


def test_a_newer_writers_extra_field_is_ignored_and_a_missing_default_is_filled():
    wire = {"v": VERSION, "t": "CachedRequestData",
            "d": {"request_id": "b", "new_block_ids": [3], "num_computed_tokens": 4, "num_scheduled_tokens": 1,
                  "from_the_future": 1}}
    assert codec.unpack(msgpack.packb(wire)) == CachedRequestData("b", [3], 4, 1)
    wire = {"v": VERSION, "t": "StepResult", "d": {"step_id": 3}}
    assert codec.unpack(msgpack.packb(wire)) == StepResult(3, [])


@pytest.mark.parametrize("data, reason", [
    (b"\xc1garbage", "not msgpack"),
    (msgpack.packb({"v": VERSION + 1, "t": "StepResult", "d": {}}), "version"),
    (msgpack.packb({"v": VERSION, "t": "NoSuchMessage", "d": {}}), "unknown message type"),
    (msgpack.packb([VERSION, "StepResult", {}]), "not a message envelope"),
    (msgpack.packb({"v": VERSION, "t": "StepResult", "d": [1]}), "Expected `object`, got `array`"),
    (msgpack.packb({"v": VERSION, "t": "StepResult", "d": {"sampled": []}}), "missing required field `step_id`"),
    (msgpack.packb({"v": VERSION, "t": "StepResult", "d": {"step_id": 1, "sampled": 5}}),
     r"Expected `array`, got `int` - at `\$.sampled`"),
    (msgpack.packb({"v": VERSION, "t": "StepResult", "d": {"step_id": 1, "sampled": [7]}}),
     r"Expected `object`, got `int` - at `\$.sampled\[0\]`"),
    (msgpack.packb({"v": VERSION, "t": "CachedRequestData", "d": {
        "request_id": "b", "new_block_ids": ["x"], "num_computed_tokens": 4, "num_scheduled_tokens": 1}}),
     r"Expected `int`, got `str` - at `\$.new_block_ids\[0\]`"),
    (msgpack.packb({"v": VERSION, "t": "StepResult", "d": {"step_id": 1.5}}), "Expected `int`, got `float`"),
])
def test_bad_data_is_a_codec_error(data, reason):
    with pytest.raises(codec.CodecError, match=reason):
        codec.unpack(data)


def test_the_expected_type_is_checked():
    with pytest.raises(codec.CodecError, match="expected StepPlan, got StepResult"):
        codec.unpack(codec.pack(StepResult(1)), StepPlan)


def _attributes(message) -> dict:
    return msgspec.structs.asdict(message) if isinstance(message, msgspec.Struct) else vars(message)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_map_with_extra_fields_decodes_as_the_exact_one(message):
    """A newer writer's extra field is skipped, at any message type."""
    envelope = msgpack.unpackb(codec.pack(message), raw=False)
    envelope["d"]["from_the_future"] = [1, 2]
    decoded = codec.unpack(msgpack.packb(envelope, use_bin_type=True))
    assert decoded == message and _attributes(decoded) == _attributes(message)  # nothing extra set


def test_tuples_come_back_as_tuples_and_plain_lists_as_lists():
    plan = codec.unpack(codec.pack(StepPlan(3, [], [], ["x", "y"], [(1, 2)])))
    assert plan.block_copies == [(1, 2)] and type(plan.block_copies[0]) is tuple
    assert plan.finished_request_ids == ["x", "y"]


def test_per_step_messages_are_structs_the_collector_does_not_track():
    import gc

    for message in (AllocRequest(1), AllocReply(1), StepPlan(1), StepResult(1), DeltaBatch(1), SampledToken("a", 1)):
        assert isinstance(message, msgspec.Struct) and not gc.is_tracked(message), type(message).__name__
