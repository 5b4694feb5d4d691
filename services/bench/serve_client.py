"""The load generator of `pagedserve bench serve`: streaming OpenAI clients over HTTP.

Each request is one `POST /v1/completions` with `prompt` as token ids, `stream: true`,
greedy, `ignore_eos` and `stream_options.include_usage`, so any OpenAI-compatible server
(vLLM, SGLang, TGI's messages API aside) is measured by the same code. Arrivals are a
Poisson process at `request_rate` (inf: all at once, a burst), and at most
`max_concurrency` requests are in flight.

Per request it records, on the client's clock: TTFT (send -> first non-empty chunk), the
gap between consecutive content chunks (ITL), end-to-end latency and the output token count
(the usage the server reports, else the number of content chunks).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from services.bench.workloads import BenchRequest


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


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, headers: dict) -> RequestRecord:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record = RequestRecord(num_prompt_tokens=len(req.prompt_token_ids))
    started = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    record.num_output_tokens = chunk["usage"].get("completion_tokens", 0)
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    record.ttft_s = now - started
                else:
                    record.itl_s.append(now - last)
                last = now
                num_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    record.e2e_s = time.perf_counter() - started
    record.num_output_tokens = record.num_output_tokens or num_chunks
    record.ok = True
    return record


async def run_load(base_url: str, model: str, requests: list[BenchRequest], request_rate: float,
                   max_concurrency: int | None, api_key: str | None = None, seed: int = 0,
                   on_done=None) -> tuple[list[RequestRecord], float]:
    """Send every request; (records in request order, wall seconds from first send)."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) + 8, max_keepalive_connections=64)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        async def guarded(req: BenchRequest) -> RequestRecord:
            async with limit:
                record = await _one(client, url, model, req, headers)
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
