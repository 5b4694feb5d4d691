"""RecordStore.append against real Redis: one EVAL writes many requests' events, each readable
as written; a refused event is reported and skipped, the rest written; TTLs as documented."""

from __future__ import annotations

import asyncio
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.api.records import RecordStore, events_key, record_key, refusals
from pagedserve.shared.redis_connect import async_client
from pagedserve.shared.streams import Keys
from tests.services.conftest import REDIS_URL, delete_prefix

TTL_S = 600


def event(text: str, offset: int, **extra) -> dict:
    return {"index": 0, "text": text, "token_ids": [offset + 1], "text_offset": offset, "token_offset": offset,
            **extra}


def with_store(body) -> None:
    """Run body(store, redis) on a fresh key prefix, removed afterwards."""
    prefix = f"test-append-{uuid.uuid4().hex[:10]}"

    async def run():
        r = async_client(REDIS_URL)
        try:
            await body(RecordStore(r, Keys(prefix), TTL_S), r)
        finally:
            await r.aclose()

    try:
        asyncio.run(run())
    finally:
        delete_prefix(prefix)


async def append(store: RecordStore, r, events, expire: bool = False) -> set[str]:
    pipe = r.pipeline(transaction=False)
    store.append(pipe, events, expire=expire)
    return refusals(await pipe.execute(raise_on_error=False))


def test_one_append_writes_every_requests_events_in_order():
    minus_inf = {"logprobs": [{"token_id": 2, "logprob": float("-inf"), "top_logprobs": []}]}

    async def body(store, r):
        assert await append(store, r, [("a", 1, event("é", 0), False), ("b", 1, event("x\u2028", 0), False),
                                       ("a", 2, event("\x00\"", 1, **minus_inf), False)]) == set()
        assert await store.events("a") == [(1, event("é", 0)), (2, event("\x00\"", 1, **minus_inf))]
        assert await store.events("b") == [(1, event("x\u2028", 0))]

    with_store(body)


def test_a_refused_event_is_reported_and_the_others_written():
    async def body(store, r):
        await append(store, r, [("a", 3, event("x", 0), False)])
        errors = await append(store, r, [("a", 3, event("again", 1), False), ("b", 1, event("y", 0), False),
                                         ("a", 4, event("z", 1), False)])
        assert len(errors) == 1 and "equal or smaller" in errors.pop()
        assert await store.events("a") == [(3, event("x", 0)), (4, event("z", 1))]
        assert await store.events("b") == [(1, event("y", 0))]

    with_store(body)


def test_ttls_first_event_and_final_event():
    async def body(store, r):
        await r.hset(record_key(store.keys, "a"), "meta", "{}")  # no TTL yet
        await append(store, r, [("a", 1, event("x", 0), False)])
        assert await r.ttl(events_key(store.keys, "a")) > TTL_S - 5
        assert await r.ttl(record_key(store.keys, "a")) == -1
        await r.persist(events_key(store.keys, "a"))
        await append(store, r, [("a", 2, event("y", 1), False)])  # not a refresh point
        assert await r.ttl(events_key(store.keys, "a")) == -1
        await append(store, r, [("a", 3, event("z", 2, finish_reason="stop"), True)])
        assert await r.ttl(events_key(store.keys, "a")) > TTL_S - 5
        assert await r.ttl(record_key(store.keys, "a")) > TTL_S - 5
        await r.persist(events_key(store.keys, "a"))
        await append(store, r, [("a", 4, event("w", 3), False)], expire=True)
        assert await r.ttl(events_key(store.keys, "a")) > TTL_S - 5

    with_store(body)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.text(max_size=40)), min_size=1, max_size=30))
def test_any_texts_read_back_as_written(writes):
    async def body(store, r):
        seqs: dict[str, int] = {}
        expected: dict[str, list] = {}
        batch = []
        for request_id, text in writes:
            seqs[request_id] = seqs.get(request_id, 0) + 1
            batch.append((request_id, seqs[request_id], event(text, seqs[request_id]), False))
            expected.setdefault(request_id, []).append((seqs[request_id], event(text, seqs[request_id])))
        assert await append(store, r, batch) == set()
        for request_id, events in expected.items():
            assert await store.events(request_id) == events

    with_store(body)
