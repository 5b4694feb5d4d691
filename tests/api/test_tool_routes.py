"""Tool calls on the REST and WebSocket routes, read as the OpenAI routes read them (ToolView): a
call's text is held back while streaming, and the final message carries the parsed `tool_calls`
with finish_reason "tool_calls"; a record gives the same calls, same ids, on every read."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from pagedserve.services.api.records import ChoiceState, snapshot_body
from pagedserve.services.api.tool_calls import ToolUse, ToolView
from tests.waiting import wait_for

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _stream(view: ToolView, text: str, finish: str) -> tuple[str, list[dict], str]:
    """Feed text one character a step, then the finish; (content sent, calls, finish reason)."""
    sent = "".join(view.step(text[:i], None)[0] for i in range(len(text) + 1))
    content, calls, reason = view.step(text, finish)
    return sent + content, calls, reason


def test_auto_streams_the_content_before_a_call_then_the_call():
    sent, calls, finish = _stream(ToolView(ToolUse("auto")), "Let me look.\n" + CALL, "stop")
    assert sent == "Let me look.\n" and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_auto_without_a_call_releases_a_held_partial_tag_at_the_finish():
    view = ToolView(ToolUse("auto"))
    assert view.step("Use <tool", None)[0] == "Use " and view.step("Use <tool", None)[0] == ""
    assert view.step("Use <tools wisely", "length") == ("<tools wisely", [], "length")


def test_required_and_named_send_no_content_and_unparsable_text_at_the_end():
    sent, calls, finish = _stream(ToolView(ToolUse("named")), '{"name": "f", "arguments": {}}', "stop")
    assert sent == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"} and finish == "tool_calls"
    sent, calls, finish = _stream(ToolView(ToolUse("required")), '[{"name": "f", "arguments": {"a": 1}}]', "stop")
    assert sent == "" and [c["function"]["name"] for c in calls] == ["f"] and finish == "tool_calls"
    assert _stream(ToolView(ToolUse("required")), "not json", "length") == ("not json", [], "length")


def test_an_aborted_or_failed_output_is_reported_as_it_is():
    assert ToolView(ToolUse("auto")).visible("a " + CALL, "abort") == ("a " + CALL, [], "abort")
    assert ToolView(ToolUse("named")).visible("{", "error") == ("{", [], "error")


def test_call_ids_derive_from_ids_from_else_are_random():
    ids = [ToolView(ToolUse("auto"), key).visible(CALL, "stop")[1][0]["id"] for key in ("r/0", "r/0", "r/1")]
    assert ids[0] == ids[1] != ids[2] and ids[0].startswith("call_") and len(ids[0]) == 29
    assert ToolView(ToolUse("auto")).visible(CALL, "stop")[1][0]["id"] != ToolView(ToolUse("auto")).visible(
        CALL, "stop")[1][0]["id"]


def test_a_snapshot_of_a_tool_using_record_gives_its_calls_the_same_each_read():
    meta = {"created": 1, "model": "m", "tool_use": {"mode": "auto", "parallel": True}}
    state = ChoiceState(text="Sure. " + CALL, token_ids=[1, 2], finish_reason="stop")
    first, again = (snapshot_body("req-1", meta, [state], 5) for _ in range(2))
    assert first == again and first["text"] == "Sure. " and first["finish_reason"] == "tool_calls"
    assert first["status"] == "finished" and first["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = snapshot_body("req-1", {"created": 1, "model": "m"}, [state], 5)
    assert plain["text"] == state.text and "tool_calls" not in plain and plain["finish_reason"] == "stop"


def _ws_url(api, path: str) -> str:
    return api.base_url.replace("http://", "ws://") + path


def _check_call(calls: list[dict]) -> None:
    (call,) = calls
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}


@pytest.mark.slow
def test_websocket_stream_of_a_named_tool_call(stack_api):
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}

    async def scenario():
        async with websockets.connect(_ws_url(stack_api, "/v1/stream")) as ws:
            await ws.send(json.dumps(body))
            return [json.loads(m) async for m in ws]

    messages = asyncio.run(scenario())
    deltas, final = messages[:-1], messages[-1]
    assert all(m["type"] == "delta" and m["text"] == "" for m in deltas) and deltas
    assert final["type"] == "final" and final["finish_reason"] == "tool_calls"
    assert final["usage"]["completion_tokens"] == sum(len(m["token_ids"]) for m in deltas)
    _check_call(final["tool_calls"])


@pytest.mark.slow
def test_rest_record_of_an_auto_tool_call_snapshot_and_attached(stack_api, tokenizer):
    bias = {str(t): 100 for t in tokenizer.encode("<tool_call>", add_special_tokens=False)}
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 100, "temperature": 1.0, "seed": 3,
            "logit_bias": bias, "parallel_tool_calls": False}
    with stack_api.client() as c:
        request_id = c.post("/v1/requests", json=body).json()["request_id"]
        state = wait_for(lambda: (s := c.get(f"/v1/requests/{request_id}").json())["status"] == "finished" and s,
                         120, "the REST request to finish", interval=0.1)
    assert state["finish_reason"] == "tool_calls" and state["text"] == ""
    _check_call(state["tool_calls"])

    async def attach():
        async with websockets.connect(_ws_url(stack_api, f"/v1/requests/{request_id}/stream")) as ws:
            return [json.loads(m) async for m in ws]

    replay = asyncio.run(attach())
    assert "".join(m.get("text", "") for m in replay) == ""
    assert replay[-1]["type"] == "final" and replay[-1]["finish_reason"] == "tool_calls"
    assert replay[-1]["tool_calls"] == state["tool_calls"]
