"""32 concurrent requests of different lengths through the real stack, over the three
client surfaces at once (REST submit + poll, WebSocket stream, OpenAI SSE stream): every
one completes with the greedy text and token ids the in-process engine gives for the same
prompt, and afterwards the kvstore holds no block.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import websockets

from pagedserve.shared.messages import SamplingParams

pytestmark = pytest.mark.slow

NUM_REQUESTS = 32
SUBJECTS = ["the moon", "bread", "rivers", "a violin", "winter", "bees", "the ocean", "mountains"]


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell me one fact about {SUBJECTS[i % len(SUBJECTS)]}. (#{i})"}]


def _max_tokens(i: int) -> int:
    return 4 + (i * 7) % 29  # 4..32: every request a different length


@pytest.fixture(scope="module")
def reference(tokenizer, engine_f32):
    """The in-process engine's greedy outputs, all 32 in one batch (float32 greedy tokens do not
    depend on the batch: tests/e2e check alone against batched), each its own max_tokens."""
    return engine_f32.generate([tokenizer.apply_chat_template(_chat(i)) for i in range(NUM_REQUESTS)],
                               [SamplingParams(max_tokens=_max_tokens(i), temperature=0.0) for i in range(NUM_REQUESTS)],
                               decode=True)


async def _rest(http: httpx.AsyncClient, i: int) -> tuple[str, list[int]]:
    r = await http.post("/v1/requests", json={"messages": _chat(i), "max_tokens": _max_tokens(i), "temperature": 0})
    assert r.status_code == 202, r.text
    request_id = r.json()["request_id"]
    for _ in range(6000):
        state = (await http.get(f"/v1/requests/{request_id}")).json()
        if state["status"] in ("finished", "aborted"):
            assert state["status"] == "finished", state
            return state["text"], state["token_ids"]
        await asyncio.sleep(0.05)  # polling interval, not a wait for a condition
    raise TimeoutError(f"REST request {i} did not finish")


async def _ws(base_url: str, i: int) -> tuple[str, list[int]]:
    async with websockets.connect(base_url.replace("http://", "ws://") + "/v1/stream") as ws:
        await ws.send(json.dumps({"messages": _chat(i), "max_tokens": _max_tokens(i), "temperature": 0}))
        messages = [json.loads(m) async for m in ws]
    assert messages[-1]["type"] == "final", messages[-1]
    deltas = messages[:-1]
    return "".join(m["text"] for m in deltas), [t for m in deltas for t in m["token_ids"]]


async def _sse(oai: openai.AsyncOpenAI, i: int) -> tuple[str, None]:
    stream = await oai.chat.completions.create(model="smollm2", messages=_chat(i), max_tokens=_max_tokens(i),
                                               temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None


def test_32_concurrent_requests_over_rest_websocket_and_sse(stack_api, backend, reference):
    async def scenario():
        async with httpx.AsyncClient(base_url=stack_api.base_url, timeout=300) as http, \
                openai.AsyncOpenAI(base_url=stack_api.base_url + "/v1", api_key="unused", max_retries=0,
                                   timeout=300) as oai:
            surfaces = (lambda i: _rest(http, i), lambda i: _ws(stack_api.base_url, i), lambda i: _sse(oai, i))
            return await asyncio.gather(*(surfaces[i % 3](i) for i in range(NUM_REQUESTS)))

    kv_before = backend.stats("kvstore") or {}
    results = asyncio.run(scenario())
    for i, ((text, token_ids), ref) in enumerate(zip(results, reference, strict=True)):
        assert text == ref.text, (i, ["rest", "websocket", "sse"][i % 3])
        if token_ids is not None:
            assert token_ids == ref.token_ids, i
    backend.wait_kvstore_clean(timeout=60, since=kv_before)
