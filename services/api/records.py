"""Request records in Redis, so any api replica can answer for any request.

{prefix}:req:R is a hash ("meta" JSON, "submit" packed SubmitRequest); {prefix}:req:R:ev a stream
of JSON events of one choice each, ids 0-<seq> (the resume cursor), both expiring record_ttl_s
after the last write. text_offset/token_offset let a reader drop what it already has. A chat with
tools is read through tool_calls.ToolView: its calls' text held back, then parsed at the finish.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis

from pagedserve.services.api.tool_calls import ToolUse, ToolView
from pagedserve.shared import redis_io
from pagedserve.shared.codec import pack, unpack
from pagedserve.shared.messages import SubmitRequest
from pagedserve.shared.streams import Keys

EVENT = b"e"
TTL_EVERY = 64  # events between two refreshes of a running record's TTL
_encode = msgspec.json.Encoder().encode
WRITER_GONE_S = 30.0  # a follower gives up on a record whose writer has had no heartbeat this long


def record_key(keys: Keys, request_id: str) -> str:
    return keys._k("req", request_id)


def events_key(keys: Keys, request_id: str) -> str:
    return keys._k("req", request_id, "ev")


def event_id(seq: int) -> str:
    return f"0-{seq}"


def refusals(replies: list) -> set[str]:
    """The errors in a pipeline's replies (raise_on_error=False), an append's refused events among them."""
    found = {str(r) for r in replies if isinstance(r, Exception)}
    return found | {e.decode() if isinstance(e, bytes) else str(e) for r in replies if isinstance(r, list) for e in r}


def seq_of(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[2])


@dataclass
class ChoiceState:
    """What a reader holds of one choice: trims replayed events by their offsets."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None

    def take(self, event: dict) -> dict | None:
        """The part of `event` not seen yet (None: nothing new); updates the state."""
        skip_ids = len(self.token_ids) - event.get("token_offset", 0)
        skip_text = len(self.text) - event.get("text_offset", 0)
        ids = event.get("token_ids", [])[max(skip_ids, 0):]
        text = event.get("text", "")[max(skip_text, 0):]
        self.token_ids.extend(ids)
        self.text += text
        new = {**event, "text": text, "token_ids": ids}
        if event.get("finish_reason") is not None:
            if self.finish_reason is not None:
                return None if not (ids or text) else {**new, "finish_reason": None}
            self.finish_reason, self.usage, self.error = event["finish_reason"], event.get("usage"), event.get("error")
        elif not ids and not text:
            return None
        return new


def status_of(states: list[ChoiceState]) -> str:
    if all(s.finish_reason is not None for s in states):
        reasons = {s.finish_reason for s in states}
        return "error" if "error" in reasons else "aborted" if "abort" in reasons else "finished"
    return "running" if any(s.token_ids for s in states) else "queued"


def total_usage(states: list[ChoiceState], num_prompt_tokens: int) -> dict:
    cached = max((s.usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0) for s in states)
    completion = sum(len(s.token_ids) for s in states)
    usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
             "total_tokens": num_prompt_tokens + completion}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _event_json(event: dict) -> bytes | str:
    """msgspec's UTF-8 JSON; json's where logprobs may hold -inf (its -Infinity reads back, null would not)."""
    return json.dumps(event, ensure_ascii=False) if "logprobs" in event else _encode(event)


# ARGV: ttl, the event field, then one msgpack array of [events key, id, JSON, expiry(, record key)] per event
# (expiry 0: none, 1: the events' TTL, 2: the record's too). The keys ride in the payload, not KEYS:
# one argument for the whole batch, where one per key costs redis-py's Python packing (standalone
# Redis and Sentinel only; a Cluster would need one call per slot). An event refused (an id not
# above its stream's last) is skipped and its error returned: the others are written still.
_APPEND = """
local ttl, errors = ARGV[1], {}
for _, e in ipairs(cmsgpack.unpack(ARGV[3])) do
  local reply = redis.pcall('XADD', e[1], e[2], ARGV[2], e[3])
  if type(reply) == 'table' and reply.err then errors[#errors + 1] = reply.err end
  if e[4] > 0 then redis.call('EXPIRE', e[1], ttl) end
  if e[4] > 1 then redis.call('EXPIRE', e[5], ttl) end
end
return errors
"""
_pack_events = msgspec.msgpack.Encoder().encode


def _event_text(event: dict) -> str:
    """As str: Redis's cmsgpack reads msgpack str, not bin."""
    text = _event_json(event)
    return text if isinstance(text, str) else text.decode()


class RecordStore:
    def __init__(self, r: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self.r, self.keys, self.ttl_s = r, keys, ttl_s

    def create(self, pipe, request_id: str, meta: dict, submit: SubmitRequest) -> None:
        """Queue the record's creation on `pipe` (sent with the submission itself)."""
        key = record_key(self.keys, request_id)
        pipe.hset(key, mapping={"meta": json.dumps(meta), "submit": pack(submit)})
        pipe.expire(key, self.ttl_s)

    def append(self, pipe, events: list[tuple[str, int, dict, bool]], expire: bool = False) -> None:
        """Queue append_command(events) on `pipe`."""
        if events:
            pipe.execute_command(*self.append_command(events, expire))

    def append_command(self, events: list[tuple[str, int, dict, bool]], expire: bool = False) -> tuple:
        """(request id, seq, event, final)s as one EVAL; the TTL is refreshed on the first, every
        TTL_EVERY-th and the last event of a request (expire: on every event)."""
        batch = []
        for request_id, seq, event, final in events:
            entry = [events_key(self.keys, request_id), event_id(seq), _event_text(event),
                     2 if final else 1 if expire or seq % TTL_EVERY == 1 else 0]
            batch.append([*entry, record_key(self.keys, request_id)] if final else entry)
        return "EVAL", _APPEND, 0, self.ttl_s, EVENT, _pack_events(batch)

    async def load(self, request_id: str) -> tuple[dict, SubmitRequest] | None:
        fields = await self.r.hgetall(record_key(self.keys, request_id))
        if not fields or b"meta" not in fields:
            return None
        return json.loads(fields[b"meta"]), unpack(fields[b"submit"])

    async def events(self, request_id: str, after: int = 0, upto: int | None = None) -> list[tuple[int, dict]]:
        entries = await self.r.xrange(events_key(self.keys, request_id), min=f"({event_id(after)}",
                                      max=event_id(upto) if upto is not None else "+")
        return [(seq_of(entry_id), json.loads(fields[EVENT])) for entry_id, fields in entries]

    async def wait_events(self, request_id: str, after: int, block_ms: int) -> list[tuple[int, dict]]:
        reply = await self.r.xread({events_key(self.keys, request_id): event_id(after)}, count=256, block=block_ms)
        return [(seq_of(entry_id), json.loads(fields[EVENT])) for _key, entries in reply or [] for entry_id, fields
                in entries]

    async def snapshot(self, request_id: str) -> dict | None:
        """The GET /v1/requests/{id} body, or None if there is no such record."""
        loaded = await self.load(request_id)
        if loaded is None:
            return None
        meta, submit = loaded
        states = [ChoiceState() for _ in range(meta["n"])]
        for _seq, event in await self.events(request_id):
            states[event["index"]].take(event)
        return snapshot_body(request_id, meta, states, len(submit.prompt_token_ids))


    async def follow(self, request_id: str, cursor: int = 0) -> AsyncIterator[tuple[int, dict]]:
        """(seq, event) after `cursor` until every choice finished; KeyError: no record. A writer
        gone WRITER_GONE_S or a vanished record ends each open choice with finish_reason "error"."""
        loaded = await self.load(request_id)
        if loaded is None:
            raise KeyError(request_id)
        meta = loaded[0]
        states = [ChoiceState() for _ in range(meta["n"])]
        views = [tool_view(meta, request_id, i) for i in range(meta["n"])]
        for _seq, event in await self.events(request_id, upto=cursor) if cursor else []:
            states[event["index"]].take(event)
            if views[event["index"]] is not None:
                views[event["index"]].step(states[event["index"]].text, None)
        last, quiet_since = cursor, time.monotonic()
        while any(s.finish_reason is None for s in states):
            try:
                events = await self.wait_events(request_id, last, 1000)
                error = None if events else await self._writer_trouble(request_id, meta, quiet_since)
            except redis_io.REDIS_ERRORS as e:
                events = []
                error = f"redis unavailable: {e}" if time.monotonic() - quiet_since > WRITER_GONE_S else None
                await asyncio.sleep(0.5)
            if events:
                quiet_since = time.monotonic()
            for seq, event in events:
                last = seq
                new = states[event["index"]].take(event)
                view = views[event["index"]]
                if new is not None and view is not None:
                    new["text"], calls, new["finish_reason"] = view.step(states[event["index"]].text,
                                                                         new.get("finish_reason"))
                    new.update({"tool_calls": calls} if calls else {})
                if new is not None:
                    yield seq, new
            for index, state in enumerate(states):
                if error is not None and state.finish_reason is None:
                    state.finish_reason = "error"
                    yield last, {"index": index, "text": "", "token_ids": [], "finish_reason": "error", "error": error}

    async def _writer_trouble(self, request_id: str, meta: dict, quiet_since: float) -> str | None:
        quiet_s = time.monotonic() - quiet_since
        if quiet_s > 5.0 and not await self.r.exists(record_key(self.keys, request_id)):
            return "the request's record is gone (expired, or lost in a Redis restart)"
        if quiet_s < WRITER_GONE_S:
            return None
        if await redis_io.get_incarnation(self.r, self.keys, f"api:{meta['api_id']}") is None:
            return f"api {meta['api_id']}, which serves this request, is gone"
        return None


def tool_view(meta: dict, request_id: str, index: int) -> ToolView | None:
    use = meta.get("tool_use")
    return None if use is None else ToolView(ToolUse(use["mode"], parallel=use["parallel"]), f"{request_id}/{index}")


def _choice(request_id: str, meta: dict, index: int, state: ChoiceState) -> dict:
    view = tool_view(meta, request_id, index)
    text, calls, finish = (state.text, [], state.finish_reason) if view is None else \
        view.visible(state.text, state.finish_reason)
    return {"index": index, "text": text, "token_ids": state.token_ids, "finish_reason": finish} \
        | ({"tool_calls": calls} if calls else {}) | ({"error": state.error} if state.error else {})


def snapshot_body(request_id: str, meta: dict, states: list[ChoiceState], num_prompt_tokens: int) -> dict:
    per_choice = [_choice(request_id, meta, i, s) for i, s in enumerate(states)]
    body = {"request_id": request_id, "object": "request", "created": meta["created"], "model": meta["model"],
            "status": status_of(states)}
    if len(per_choice) == 1:
        body.update({k: v for k, v in per_choice[0].items() if k != "index"})
    return {**body, "choices": per_choice, "usage": total_usage(states, num_prompt_tokens)}
