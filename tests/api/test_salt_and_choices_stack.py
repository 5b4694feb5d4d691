"""`cache_salt` and `n` > 1 on every route, through the real stack (api -> scheduler ->
kvstore/worker processes, float32, 256 blocks of 16 tokens, prefix caching on) on the real
Redis.

cache_salt: requests with different salts never share prefix-cache blocks, equal salts (or
none) do, on /v1/completions, /v1/chat/completions, POST /v1/requests and the WebSocket;
the hit is read exactly from each response's cached_tokens and from the kvstore's counters.
n > 1 over REST and the WebSocket: choice i equals what seed + i gives alone in the
in-process engine (REST: `choices` by index; WebSocket: deltas and one final per index).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import websockets

from pagedserve.shared.messages import SamplingParams
from tests.services.conftest import wait_for

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
SALTED = ("The lighthouse keeper counted the ships that passed each night, writing their names in a "
          "leather book. Some were fishing boats, some were cargo ships from distant ports, and once, "
          "on a stormy night in autumn, a tall ship with silver sails that nobody else ever saw. ") * 2
CHOICES_PROMPT = "Once upon a time, in a small village by the sea, there lived"
SEED, N, MAX_TOKENS = 11, 3, 8


def _ws_messages(api, body: dict, path: str = "/v1/stream") -> list[dict]:
    """Everything the server sends until it closes (1000, or 1008 after an error)."""
    async def scenario():
        messages = []
        async with websockets.connect(api.ws_url(path)) as ws:
            if body:
                await ws.send(json.dumps(body))
            try:
                async for m in ws:
                    messages.append(json.loads(m))
            except websockets.ConnectionClosedError as e:
                assert e.rcvd is not None and e.rcvd.code == 1008, e
        return messages

    return asyncio.run(scenario())


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _rest_finished(api, body: dict) -> dict:
    with api.client() as c:
        r = c.post("/v1/requests", json=body)
        assert r.status_code == 202, r.text
        request_id = r.json()["request_id"]
        return wait_for(lambda: (s := c.get(f"/v1/requests/{request_id}").json())["status"] == "finished" and s,
                        120, "the REST request to finish", interval=0.1)


def _hits(backend) -> int:
    return (backend.stats("kvstore") or {}).get("prefix_cache_hits", 0)


def _settled_hits(backend) -> int:
    """The hit count once the kvstore's stats hold no block and stop changing: they are written a
    moment after each step, so a read right after an earlier test may miss its last admissions."""
    seen = {}

    def settled():
        stats = backend.stats("kvstore") or {}
        key = (stats.get("prefix_cache_queries"), stats.get("num_held_blocks"), stats.get("step_id"))
        if key != seen.get("key"):
            seen.update(key=key, at=time.monotonic())
            return None
        return (stats.get("prefix_cache_hits", 0),) if key[1] == 0 and time.monotonic() - seen["at"] >= 1.0 else None

    return wait_for(settled, 60, "the kvstore's stats to settle")[0]


def test_bad_cache_salt_is_a_400_on_every_route(stack_api):
    with stack_api.client() as c:
        for path, body in (("/v1/completions", {"prompt": "hi", "cache_salt": 5}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "cache_salt": "x" * 257}),
                           ("/v1/requests", {"prompt": "hi", "cache_salt": ""})):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", (path, r.text)
    (error,) = _ws_messages(stack_api, {"prompt": "hi", "cache_salt": ["a"]})
    assert (error["type"], error["status"]) == ("error", 400) and "cache_salt" in error["message"]


def test_only_requests_with_the_same_salt_share_prefix_blocks(stack_api, oai, backend, tokenizer):
    num_prompt = len(tokenizer.encode(SALTED))
    assert num_prompt > 4 * BLOCK_SIZE
    hit = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but the one holding the last token
    hits_before = _settled_hits(backend)

    def completion(**salt) -> int:
        r = oai.completions.create(model="smollm2", prompt=SALTED, max_tokens=2, temperature=0, extra_body=salt)
        assert r.usage.prompt_tokens == num_prompt
        return r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0

    assert completion(cache_salt="alice") == 0  # the first of its kind
    assert completion(cache_salt="bob") == 0  # same tokens, another salt: nothing shared
    assert completion() == 0  # no salt is a salt of its own
    rest = _rest_finished(stack_api, {"prompt": SALTED, "max_tokens": 2, "temperature": 0, "cache_salt": "alice"})
    assert _cached(rest["usage"]) == hit
    final = _ws_messages(stack_api, {"prompt": SALTED, "max_tokens": 2, "temperature": 0, "cache_salt": "bob"})[-1]
    assert final["type"] == "final" and _cached(final["usage"]) == hit
    assert completion() == hit
    assert completion(cache_salt="carol") == 0
    wait_for(lambda: _hits(backend) - hits_before == 3 * hit, 30,
             f"the kvstore to count exactly 3 x {hit} hit tokens")
    backend.wait_kvstore_clean(timeout=60)


def test_the_salt_keys_chat_prompts_too(oai, tokenizer):
    chat = [{"role": "user", "content": SALTED}]
    num_prompt = len(tokenizer.apply_chat_template(chat))
    hit = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    cached = []
    for salt in ("dora", "erin", "dora"):
        r = oai.chat.completions.create(model="smollm2", messages=chat, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt})
        cached.append(r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0)
    assert cached == [0, 0, hit]


@pytest.fixture(scope="module")
def alone(tokenizer, engine_f32) -> list:
    """Choice i of the seeded request: seed + i, alone, in the in-process engine."""
    engine = engine_f32
    outs = [engine.generate([CHOICES_PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9,
                                                             seed=SEED + i, ignore_eos=True), decode=True)[0]
            for i in range(N)]
    assert len({out.text for out in outs}) > 1
    return outs


CHOICES_BODY = {"prompt": CHOICES_PROMPT, "n": N, "seed": SEED, "temperature": 0.9, "max_tokens": MAX_TOKENS,
                "ignore_eos": True}


def test_rest_n_choices_each_equal_their_seed_alone(stack_api, alone, backend):
    kv_before = backend.stats("kvstore") or {}
    state = _rest_finished(stack_api, CHOICES_BODY)
    assert [c["index"] for c in state["choices"]] == list(range(N))
    assert [c["text"] for c in state["choices"]] == [out.text for out in alone]
    assert [c["token_ids"] for c in state["choices"]] == [out.token_ids for out in alone]
    assert [c["finish_reason"] for c in state["choices"]] == ["length"] * N
    assert "text" not in state and "token_ids" not in state  # per choice only
    assert (state["usage"]["prompt_tokens"], state["usage"]["completion_tokens"]) == \
        (len(alone[0].prompt_token_ids), N * MAX_TOKENS)
    replay = _ws_messages(stack_api, {}, f"/v1/requests/{state['request_id']}/stream")
    _check_stream(replay, alone, state["request_id"])
    backend.wait_kvstore_clean(timeout=60, since=kv_before)


def test_websocket_n_choices_stream_by_index(stack_api, alone, backend):
    kv_before = backend.stats("kvstore") or {}
    messages = _ws_messages(stack_api, CHOICES_BODY)
    request_id = messages[0]["request_id"]
    _check_stream(messages, alone, request_id)
    finals = [m for m in messages if m["type"] == "final"]
    assert [m["usage"]["completion_tokens"] for m in finals] == [MAX_TOKENS] * N
    backend.wait_kvstore_clean(timeout=60, since=kv_before)


def _check_stream(messages: list[dict], alone: list, request_id: str) -> None:
    """Deltas and one final per index; the socket closes after the last final."""
    assert messages[-1]["type"] == "final" and {m["type"] for m in messages} == {"delta", "final"}
    assert {m["request_id"] for m in messages} == {request_id}
    finals = sorted((m for m in messages if m["type"] == "final"), key=lambda m: m["index"])
    assert [(m["index"], m["finish_reason"]) for m in finals] == [(i, "length") for i in range(N)]
    for i, out in enumerate(alone):
        positions = [at for at, m in enumerate(messages) if m["index"] == i]
        *deltas, final = [messages[at] for at in positions]
        assert final["type"] == "final" and all(m["type"] == "delta" for m in deltas)  # nothing after its final
        assert "".join(m["text"] for m in deltas) == out.text
        assert [t for m in deltas for t in m["token_ids"]] == out.token_ids
