"""`pagedserve bench fairness`: tenant B's TTFT (by `user`) alone, then while tenant A floods, under
fcfs and fair (POST /admin/policy), then behind one long prompt; needs --max-num-seqs well below --flood."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx
import numpy as np

from pagedserve.services.bench.serve import LaunchedStack

PROMPT_A = "Write a long story about a lighthouse keeper."
PROMPT_B = "What is the capital of France?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="a running server; default: launch `pagedserve up`")
    parser.add_argument("--up-arg", action="append", default=None,
                        help="extra `pagedserve up` option when launching (repeat); default: --max-num-seqs 8")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--flood", type=int, default=200, help="tenant A's requests, sent at once")
    parser.add_argument("--flood-max-tokens", type=int, default=8)
    parser.add_argument("--b-requests", type=int, default=10)
    parser.add_argument("--b-interval", type=float, default=1.0, help="seconds between B's requests")
    parser.add_argument("--b-max-tokens", type=int, default=4)
    parser.add_argument("--policies", default="fcfs,fair", help="policies to compare, comma-separated ('' none)")
    parser.add_argument("--long-prompt-tokens", type=int, default=7000,
                        help="the long-prompt phase's prompt length (0: no such phase)")
    parser.add_argument("--long-after", type=float, default=0.3, help="seconds from the long prompt to B's first")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


async def _ttft(client: httpx.AsyncClient, user: str, prompt: str | list[int], max_tokens: int) -> float | None:
    """Seconds to the first text chunk; None if the request failed or got no text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "user": user}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return None
        async for line in response.aiter_lines():
            if line.startswith("data: {") and first is None:
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    first = time.perf_counter() - started
    return first


async def _tenant_b(client: httpx.AsyncClient, args: argparse.Namespace) -> list[float | None]:
    tasks = []
    for _ in range(args.b_requests):
        tasks.append(asyncio.create_task(_ttft(client, "tenant-b", PROMPT_B, args.b_max_tokens)))
        await asyncio.sleep(args.b_interval)
    return list(await asyncio.gather(*tasks))


async def _scheduler_gauge(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(f"pagedserve:{name} "):
            return float(line.split()[1])
    return 0.0


async def _wait_idle(client: httpx.AsyncClient, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await _scheduler_gauge(client, "num_requests_running")) == 0 and \
                (await _scheduler_gauge(client, "num_requests_waiting")) == 0:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the stack did not drain")


async def _phase(client: httpx.AsyncClient, args: argparse.Namespace, policy: str | None) -> dict:
    flood: list[asyncio.Task] = []
    if policy is not None:
        response = await client.post("/admin/policy", json={"name": policy, "options": {}})
        response.raise_for_status()
        flood = [asyncio.create_task(_ttft(client, "tenant-a", PROMPT_A, args.flood_max_tokens))
                 for _ in range(args.flood)]
        deadline = time.monotonic() + 60
        while await _scheduler_gauge(client, "num_requests_waiting") < args.flood / 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    queued = await _scheduler_gauge(client, "num_requests_waiting")
    ttfts = await _tenant_b(client, args)
    num_a_done = sum(1 for t in flood if t.done() and not t.cancelled() and t.exception() is None)
    for task in flood:
        task.cancel()  # the client goes away: the api aborts what is still queued or running
    await asyncio.gather(*flood, return_exceptions=True)
    await _wait_idle(client)
    return _row(policy or "alone", ttfts, {"a_waiting_when_b_started": int(queued), "a_done_while_b_ran": num_a_done})


def _row(phase: str, ttfts: list[float | None], extra: dict) -> dict:
    ok = [t for t in ttfts if t is not None]
    row = {"phase": phase, "b_num_ok": len(ok), "b_num_failed": len(ttfts) - len(ok), **extra}
    for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
        row[f"b_ttft_{name}_ms"] = round(float(np.percentile(ok, q)) * 1000, 1) if ok else None
    return row


async def _long_prompt_phase(client: httpx.AsyncClient, args: argparse.Namespace) -> dict:
    """B's TTFT while one --long-prompt-tokens prompt prefills (random ids: no prefix-cache hit)."""
    rng = random.Random()
    prompt = [rng.randrange(1000, 30000) for _ in range(args.long_prompt_tokens)]
    started = time.perf_counter()
    long = asyncio.create_task(_ttft(client, "tenant-a", prompt, 1))
    await asyncio.sleep(args.long_after)
    ttfts = await _tenant_b(client, args)
    b_done = time.perf_counter() - started
    long_ttft = await long
    await _wait_idle(client)
    return _row(f"long-{args.long_prompt_tokens}", ttfts, {
        "long_ttft_ms": None if long_ttft is None else round(long_ttft * 1000, 1),
        "b_done_before_long": long_ttft is not None and b_done < long_ttft})


async def _run(base_url: str, args: argparse.Namespace) -> list[dict]:
    limits = httpx.Limits(max_connections=args.flood + args.b_requests + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await _ttft(client, "warm-up", PROMPT_B, 2)
        rows = [await _phase(client, args, None)]
        for policy in filter(None, (p.strip() for p in args.policies.split(","))):
            rows.append(await _phase(client, args, policy))
        await client.post("/admin/policy", json={"name": "fcfs", "options": {}})
        if args.long_prompt_tokens > 0:
            rows.append(await _long_prompt_phase(client, args))
    alone = rows[0]["b_ttft_p99_ms"]
    for row in rows:
        p99 = row["b_ttft_p99_ms"]
        row["b_p99_vs_alone"] = round(p99 / alone, 2) if p99 and alone else None
    return rows


def run(args: argparse.Namespace) -> int:
    stack = None
    if args.url is None:
        stack = LaunchedStack(args.up_arg or ["--max-num-seqs", "8"], args.dtype)
    try:
        rows = asyncio.run(_run(args.url or stack.base_url, args))
    finally:
        if stack is not None:
            stack.stop()
    columns = list(dict.fromkeys(c for row in rows for c in row))
    print("  ".join(f"{c:>24}" for c in columns))
    for row in rows:
        print("  ".join(f"{row.get(c, '-')!s:>24}" for c in columns))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0 if all(r["b_num_failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m pagedserve.services.bench.fairness", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
