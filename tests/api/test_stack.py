"""The whole stack for real: an api process in front of the scheduler, kvstore and worker
processes (float32, 256 blocks) on the real Redis, driven by real clients (the official
openai client, a websockets client, httpx).

Greedy output must equal the in-process Engine's for the same prompts; every way a client
can leave (DELETE, closing the WebSocket, dropping an SSE stream, hanging up a
non-streaming call, leaving while still queued) must free its blocks, as the kvstore's
stats blob shows (num_held_blocks == 0 and integrity_ok).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from pagedserve.shared.messages import SamplingParams
from tests.api.conftest import hanging_call
from tests.api.test_inputs import BAD_BODIES
from tests.services.conftest import wait_for

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "Write a haiku about the sea 🌊."}],
]
MAX_TOKENS = 24
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # runs until someone stops it
RESUMED_TOKENS = 32  # compared with an uninterrupted run after a scheduler restart


@pytest.fixture(scope="module")
def reference(tokenizer, engine_f32):
    """Greedy outputs of the in-process engine, one request at a time like the tests send."""
    engine = engine_f32
    outputs = []
    for chat in CHATS:
        (out,) = engine.generate([tokenizer.apply_chat_template(chat)],
                                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), decode=True)
        outputs.append(out)
    return outputs


def _ws_url(api, path: str) -> str:
    return api.base_url.replace("http://", "ws://") + path


def _kv(backend) -> dict:
    return backend.stats("kvstore") or {}


def _wait_holding(backend) -> None:
    wait_for(lambda: _kv(backend).get("num_held_blocks", 0) > 0, 120, "the request to hold blocks")


def _wait_clean(backend) -> None:
    backend.wait_kvstore_clean(timeout=60)
    wait_for(lambda: (backend.stats("scheduler") or {}).get("num_requests_running", 1) == 0
             and backend.stats("scheduler").get("num_requests_waiting", 1) == 0, 60, "the scheduler to be idle")


def test_openai_chat_matches_the_engine(oai, reference, tokenizer):
    for chat, ref in zip(CHATS, reference, strict=True):
        r = oai.chat.completions.create(model="smollm2", messages=chat, max_tokens=MAX_TOKENS, temperature=0)
        assert r.object == "chat.completion" and r.model == "smollm2" and r.id and r.created
        choice = r.choices[0]
        assert choice.index == 0 and choice.message.role == "assistant"
        assert choice.message.content == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_openai_chat_streaming_matches_the_engine(oai, reference):
    for chat, ref in zip(CHATS, reference, strict=True):
        chunks = list(oai.chat.completions.create(model="smollm2", messages=chat, max_tokens=MAX_TOKENS,
                                                  temperature=0, stream=True,
                                                  stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == [ref.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
        assert chunks[0].choices[0].delta.role == "assistant"


def test_openai_completions_whole_and_streamed_agree(oai, tokenizer):
    prompt = "The three primary colors are"
    whole = oai.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length")
    logprobs = whole.choices[0].logprobs
    assert len(logprobs.tokens) == whole.usage.completion_tokens == len(logprobs.token_logprobs)
    streamed = list(oai.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    models = oai.models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_stop_string_cuts_the_text_and_ends_the_request(oai, reference, backend):
    ref = reference[0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {ref!r}"
    r = oai.chat.completions.create(model="smollm2", messages=CHATS[0], max_tokens=MAX_TOKENS, temperature=0,
                                    stop=[stop])
    assert r.choices[0].message.content == ref[:ref.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    _wait_clean(backend)


def test_websocket_streams_to_the_end(stack_api, reference):
    async def scenario():
        async with websockets.connect(_ws_url(stack_api, "/v1/stream")) as ws:
            await ws.send(json.dumps({"messages": CHATS[1], "max_tokens": MAX_TOKENS, "temperature": 0}))
            messages = [json.loads(m) async for m in ws]
        return messages

    messages = asyncio.run(scenario())
    deltas, final = messages[:-1], messages[-1]
    assert deltas and all(m["type"] == "delta" for m in deltas)
    assert "".join(m["text"] for m in deltas) == reference[1].text
    assert [t for m in deltas for t in m["token_ids"]] == reference[1].token_ids
    assert final["type"] == "final" and final["finish_reason"] == reference[1].finish_reason
    assert final["usage"]["completion_tokens"] == len(reference[1].token_ids)


def test_rest_submit_poll_and_attach(stack_api, reference):
    with stack_api.client() as c:
        request_id = c.post("/v1/requests", json={"messages": CHATS[0], "max_tokens": MAX_TOKENS,
                                                  "temperature": 0}).json()["request_id"]
        state = wait_for(lambda: (s := c.get(f"/v1/requests/{request_id}").json())["status"] == "finished" and s,
                         120, "the REST request to finish", interval=0.1)
    assert state["text"] == reference[0].text and state["token_ids"] == reference[0].token_ids
    assert state["usage"]["completion_tokens"] == len(reference[0].token_ids)

    async def attach():
        async with websockets.connect(_ws_url(stack_api, f"/v1/requests/{request_id}/stream")) as ws:
            return [json.loads(m) async for m in ws]

    replay = asyncio.run(attach())
    assert "".join(m.get("text", "") for m in replay) == reference[0].text
    assert replay[-1]["type"] == "final"


def test_bad_inputs_then_the_stack_still_serves(stack_api, oai, backend):
    with stack_api.client() as c:
        for body, status, _code in BAD_BODIES:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = c.post("/v1/requests", content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
    r = oai.completions.create(model="smollm2", prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    _wait_clean(backend)


def test_delete_frees_blocks(stack_api, backend):
    with stack_api.client() as c:
        request_id = c.post("/v1/requests", json={"prompt": "Count: 1, 2, 3,", **LONG}).json()["request_id"]
        wait_for(lambda: c.get(f"/v1/requests/{request_id}").json()["status"] == "running", 120, "running")
        _wait_holding(backend)
        assert c.delete(f"/v1/requests/{request_id}").json()["status"] == "aborted"
    _wait_clean(backend)


def test_closing_the_websocket_frees_blocks(stack_api, backend):
    async def scenario():
        async with websockets.connect(_ws_url(stack_api, "/v1/stream")) as ws:
            await ws.send(json.dumps({"prompt": "Once upon a time", **LONG}))
            assert json.loads(await ws.recv())["type"] == "delta"

    asyncio.run(scenario())
    _wait_clean(backend)


def test_dropping_an_sse_stream_frees_blocks(stack_api, backend):
    with stack_api.client() as c, c.stream("POST", "/v1/chat/completions",
                                           json={"messages": CHATS[0], "stream": True, **LONG}) as r:
        lines = r.iter_lines()
        wait_for(lambda: '"content":"' in next(lines) and _kv(backend).get("num_held_blocks"), 120, "streaming")
    _wait_clean(backend)


def test_non_streaming_client_hanging_up_frees_blocks(stack_api, backend):
    with hanging_call(stack_api, "/v1/completions", {"prompt": "Once upon a time", **LONG}):
        _wait_holding(backend)  # it runs while the client waits, then the client hangs up
    _wait_clean(backend)


def test_leaving_while_queued_frees_everything(stack_api, backend, tokenizer):
    """A request runs; a second one, larger than the blocks left (256 in all: 75 + 188 > 256),
    cannot be admitted and waits; its client hangs up while it is queued; then the first one's
    client leaves. The second prompt shares no prefix with the first, so the prefix cache cannot
    admit it. The running prompt is the shorter: it is prefilled, the queued one never is."""
    running_prompt = tokenizer.encode("word " * 1200)[:1200]
    queued_prompt = tokenizer.encode("other " * 3000)[:3000]

    with stack_api.client(timeout=300) as c, c.stream("POST", "/v1/completions",
                                                      json={"prompt": running_prompt, "stream": True, **LONG}) as r:
        lines = r.iter_lines()
        wait_for(lambda: next(lines).startswith("data:"), 300, "the first request to stream")
        with hanging_call(stack_api, "/v1/completions", {"prompt": queued_prompt, **LONG}):  # hangs up queued
            wait_for(lambda: backend.stats("scheduler")["num_requests_waiting"] == 1, 60, "the second to wait")
        wait_for(lambda: backend.stats("scheduler")["num_requests_waiting"] == 0, 60, "the queued one to be gone")
        assert backend.stats("scheduler")["num_requests_running"] == 1
    _wait_clean(backend)


def family_sums(text: str) -> dict[str, float]:
    """Each series name (labels dropped) -> the sum of its samples: every engine series is per worker."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pagedserve:"):
            series, value = line.rsplit(" ", 1)
            values[series.split("{")[0]] = values.get(series.split("{")[0], 0.0) + float(value)
    return values


def test_metrics_after_traffic(stack_api):
    text = httpx.get(stack_api.base_url + "/metrics").text
    values = family_sums(text)
    assert values["pagedserve:time_to_first_token_seconds_count"] > 0
    assert values["pagedserve:e2e_request_latency_seconds_count"] > 0
    assert values["pagedserve:generation_tokens_total"] > 0 and values["pagedserve:prompt_tokens_total"] > 0
    assert values["pagedserve:kv_cache_usage_perc"] == 0.0


def test_scheduler_restart_resumes_in_flight_requests(stack_api, backend):
    """Kill -9 the scheduler mid-generation: the api resubmits with the tokens delivered so
    far and the new scheduler continues as an uninterrupted run does. The killed request runs
    until aborted, so the kill lands mid-generation however fast the machine; the uninterrupted
    run is made after, as long as what the resumed one produced. Last in the module: it restarts
    a back-end process."""
    body = {"messages": CHATS[1], "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with stack_api.client() as c:
        def state(request_id, done):
            current = c.get(f"/v1/requests/{request_id}").json()
            return current if done(current) else None

        request_id = c.post("/v1/requests", json=body).json()["request_id"]
        wait_for(lambda: state(request_id, lambda s: len(s["token_ids"]) >= 5), 120, "some tokens")
        backend.kill("scheduler")
        at_kill = c.get(f"/v1/requests/{request_id}").json()
        assert at_kill["status"] == "running"
        backend.start("scheduler")
        wanted = len(at_kill["token_ids"]) + RESUMED_TOKENS  # past the kill (but for deltas not yet read)
        resumed = wait_for(lambda: state(request_id, lambda s: len(s["token_ids"]) >= wanted), 300,
                           f"{RESUMED_TOKENS} tokens after the restart", interval=0.2)
        assert c.delete(f"/v1/requests/{request_id}").json()["status"] == "aborted"
        n = len(resumed["token_ids"])
        first = c.post("/v1/requests", json={**body, "max_tokens": n}).json()["request_id"]
        expected = wait_for(lambda: state(first, lambda s: s["status"] == "finished"), 300, "the uninterrupted run",
                            interval=0.2)
    assert expected["finish_reason"] == "length" and resumed["token_ids"] == expected["token_ids"]
    assert expected["text"].startswith(resumed["text"])
    _wait_clean(backend)
