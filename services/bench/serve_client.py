"""`pagedserve bench serve`'s load generator: streamed greedy `POST /v1/completions` with Poisson
arrivals, measuring client-side TTFT, ITL and latency of any OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from pagedserve.services.bench.http_stream import StreamError, post_sse
from pagedserve.services.bench.workloads import BenchRequest


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for a one-token answer."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


class _Tally:
    """Turns a stream's `data:` payloads into a RequestRecord's timings and counts."""

    def __init__(self, record: RequestRecord, started: float):
        self.record, self.started, self.last = record, started, started
        self.num_chunks = 0
        self.ended = False  # [DONE] seen

    def on_data(self, data: bytes | str, now: float) -> None:
        if self.ended or not data:
            return
        if data in (b"[DONE]", "[DONE]"):
            self.ended = True
            return
        has_text = _has_text(data)
        if has_text is None:  # not sure without parsing it
            chunk = json.loads(data)
            if chunk.get("usage"):
                self.record.num_output_tokens = chunk["usage"].get("completion_tokens", 0)
            choices = chunk.get("choices") or []
            has_text = bool(choices and choices[0].get("text"))
        if not has_text:
            return
        if self.num_chunks == 0:
            self.record.ttft_s = now - self.started
        else:
            self.record.itl_s.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def finish(self) -> RequestRecord:
        self.record.e2e_s = time.perf_counter() - self.started
        self.record.num_output_tokens = self.record.num_output_tokens or self.num_chunks
        self.record.ok = True
        return self.record


def _has_text(data: bytes | str) -> bool | None:
    """Whether a chunk's choice carries text, without parsing the JSON; None: parse it."""
    if isinstance(data, str):
        return None
    key = data.find(b'"text":')
    if key < 0 or data.find(b'"text":', key + 1) >= 0 or b'"usage":{' in data:
        return None
    value = data[key + 7:key + 12].lstrip()
    if value.startswith(b'""'):
        return False
    return True if value.startswith(b'"') else None


def _body(model: str, req: BenchRequest) -> dict:
    return {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": req.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}


async def _one_lean(url: str, model: str, req: BenchRequest, headers: dict) -> RequestRecord:
    """An http:// server: pagedserve.services.bench.http_stream, the client's CPU kept off the server's."""
    record = RequestRecord(num_prompt_tokens=len(req.prompt_token_ids))
    tally = _Tally(record, time.perf_counter())
    try:
        status, error_body = await post_sse(url, json.dumps(_body(model, req)).encode(), headers, tally.on_data)
    except (StreamError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if status != 200:
        record.error = f"HTTP {status}: {error_body[:200]!r}"
        return record
    return tally.finish()


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, headers: dict) -> RequestRecord:
    """Any server httpx reaches (https included)."""
    record = RequestRecord(num_prompt_tokens=len(req.prompt_token_ids))
    tally = _Tally(record, time.perf_counter())
    try:
        async with client.stream("POST", url, json=_body(model, req), headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    tally.on_data(line[5:].strip(), time.perf_counter())
                if tally.ended:
                    break
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    return tally.finish()


async def run_load(base_url: str, model: str, requests: list[BenchRequest], request_rate: float,
                   max_concurrency: int | None, api_key: str | None = None, seed: int = 0,
                   on_done=None) -> tuple[list[RequestRecord], float]:
    """Send every request; (records in request order, wall seconds from first send)."""
    url = base_url.rstrip("/") + "/v1/completions"
    lean = url.startswith("http://")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) + 8, max_keepalive_connections=64)

    # httpx only for https: the lean reader opens its own connections
    client = None if lean else httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits)
    async with client or contextlib.nullcontext():
        async def guarded(req: BenchRequest) -> RequestRecord:
            async with limit:
                record = await (_one_lean(url, model, req, headers) if client is None
                                else _one(client, url, model, req, headers))
            if on_done is not None:
                on_done(record)
            return record

        started = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(guarded(req)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - started
