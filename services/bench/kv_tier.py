"""`python -m pagedserve.services.bench.kv_tier`: the offload tier's done-when workloads against a
running api, one streamed greedy request at a time (client-side TTFT, cached_tokens from usage).

eviction: 6 distinct prefixes of --prefix-tokens, 3 rounds over the 6 with short distinct suffixes;
  run against a pool that holds about 2 of them (--num-blocks), with and without the tier.
across: --pairs prefixes of --prefix-tokens, each sent twice (a different suffix the second time):
  under --workers 2 --router round-robin the second lands on the other worker.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import httpx

SUFFIX_TOKENS = 16


def tokens(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def one(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """TTFT (s) and cached_tokens of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started, ttft, cached = time.perf_counter(), None, 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": len(prompt)}


def eviction(client: httpx.Client, args) -> dict:
    rounds = []
    for round_index in range(args.rounds):
        records = [one(client, args.model, tokens(p, args.prefix_tokens) + tokens(1000 + 10 * round_index + p,
                                                                                   SUFFIX_TOKENS), args.max_tokens)
                   for p in range(args.prefixes)]
        rounds.append(records)
    later = [r for records in rounds[1:] for r in records]
    return {"rounds": [summary(records, args.prefix_tokens) for records in rounds],
            "later_rounds": summary(later, args.prefix_tokens)}


def across(client: httpx.Client, args) -> dict:
    first, second = [], []
    for p in range(args.pairs):
        first.append(one(client, args.model, tokens(500 + p, args.prefix_tokens) + tokens(2000 + p, SUFFIX_TOKENS),
                         args.max_tokens))
        second.append(one(client, args.model, tokens(500 + p, args.prefix_tokens) + tokens(3000 + p, SUFFIX_TOKENS),
                          args.max_tokens))
    return {"first": summary(first, args.prefix_tokens), "second": summary(second, args.prefix_tokens)}


def summary(records: list[dict], prefix_tokens: int) -> dict:
    ttfts = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    cached = sum(r["cached_tokens"] for r in records)
    return {"n": len(records), "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttft_s": [round(t, 4) for t in ttfts], "cached_tokens": [r["cached_tokens"] for r in records],
            "prefix_cached_frac": round(cached / (prefix_tokens * len(records)), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.services.bench.kv_tier")
    parser.add_argument("scenario", choices=["eviction", "across"])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=600.0) as client:
        result = eviction(client, args) if args.scenario == "eviction" else across(client, args)
    json.dump({"scenario": args.scenario, **vars(args), **result}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
