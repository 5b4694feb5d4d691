"""n > 1 and the prefix-cache reset through the real stack: the official openai client ->
api -> scheduler -> kvstore/worker processes (float32, 256 blocks, prefix caching on by
default) on the real Redis. Each of the n choices equals what its seed (seed + index)
gives alone in the in-process engine; the prompt's partial last block is copied on write;
POST /admin/prefix-cache/reset empties the cache; everything ends with no block held."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedserve.shared.messages import SamplingParams
from tests.api.conftest import API_KEY
from tests.api.test_stack import family_sums
from tests.services.conftest import wait_for

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived"
SEED, N, MAX_TOKENS = 11, 3, 8


@pytest.fixture(scope="module")
def engine(engine_f32):
    return engine_f32


def _kv(backend) -> dict:
    return backend.stats("kvstore") or {}


def test_n_seeded_choices_each_equal_their_seed_alone(oai, engine, backend):
    kv_before = _kv(backend)
    r = oai.completions.create(model="smollm2", prompt=PROMPT, n=N, seed=SEED, temperature=0.9,
                               max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(N))
    alone = [engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=SEED + i,
                                                      ignore_eos=True), decode=True)[0].text for i in range(N)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (num_prompt, N * MAX_TOKENS)
    kv_after = backend.wait_kvstore_clean(timeout=60, since=kv_before)
    expected_copies = 0 if (num_prompt - 1) % 16 == 0 else N - 1
    assert kv_after["num_block_copies"] - kv_before.get("num_block_copies", 0) == expected_copies


def test_n_greedy_chat_choices_stream_by_index(oai, engine, tokenizer, backend):
    chat = [{"role": "user", "content": "Name a color."}]
    kv_before = _kv(backend)
    (greedy,) = engine.generate([tokenizer.apply_chat_template(chat)],
                                SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), decode=True)
    texts, finishes = ["", ""], [None, None]
    for chunk in oai.chat.completions.create(model="smollm2", messages=chat, n=2, temperature=0,
                                             max_tokens=MAX_TOKENS, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [greedy.text, greedy.text]
    assert finishes == [greedy.finish_reason] * 2
    backend.wait_kvstore_clean(timeout=60, since=kv_before)


def test_the_admin_reset_empties_the_prefix_cache(stack_api, oai, backend):
    for _ in range(2):  # the second is a hit
        oai.completions.create(model="smollm2", prompt=PROMPT * 4, max_tokens=2, temperature=0)
    wait_for(lambda: _kv(backend).get("num_cached_blocks", 0) > 0, 60, "blocks to be cached")
    with stack_api.client() as client:
        r = client.post("/admin/prefix-cache/reset")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "reset" and r.json()["num_cached_blocks"] == 0
        metrics = client.get("/metrics").text
    values = family_sums(metrics)
    assert values["pagedserve:prefix_cache_resets_total"] >= 1
    assert values["pagedserve:prefix_cache_queries_total"] >= values["pagedserve:prefix_cache_hits_total"] > 0
    assert values["pagedserve:kv_cache_cached_free_blocks"] == 0
    # the same prompt again is a miss now
    again = oai.completions.create(model="smollm2", prompt=PROMPT * 4, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details is None or not again.usage.prompt_tokens_details.cached_tokens


def test_the_admin_reset_needs_the_api_key(api_alone):
    r = httpx.post(api_alone.base_url + "/admin/prefix-cache/reset", timeout=10)
    assert r.status_code == 401 and json.loads(r.text)["error"]["code"] == "invalid_api_key"
    assert API_KEY not in r.text
