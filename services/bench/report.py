"""Summaries and tables shared by the benchmarks: latency percentiles, a results table.

A result is a flat dict (system, wall_s, num_requests, output_tokens, prompt_tokens,
output_tok_s, total_tok_s, request_s; serve adds `<ttft|tpot|itl|e2e>_<mean|p50|p90|p99>_ms`).
"""

from __future__ import annotations

import math

LATENCY_STATS = ("mean", "p50", "p90", "p99")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_summary(name: str, values_s: list[float]) -> dict[str, float]:
    """{name_mean_ms, name_p50_ms, name_p90_ms, name_p99_ms} from seconds."""
    mean = sum(values_s) / len(values_s) if values_s else math.nan
    out = {f"{name}_mean_ms": mean * 1000.0}
    for q in (50, 90, 99):
        out[f"{name}_p{q}_ms"] = percentile(values_s, q) * 1000.0
    return out


def throughput_fields(wall_s: float, num_requests: int, output_tokens: int, prompt_tokens: int) -> dict:
    return {"wall_s": wall_s, "num_requests": num_requests, "output_tokens": output_tokens,
            "prompt_tokens": prompt_tokens, "output_tok_s": output_tokens / wall_s,
            "total_tok_s": (output_tokens + prompt_tokens) / wall_s, "request_s": num_requests / wall_s}


def _cell(value) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.2f}"
    return str(value)


def print_table(results: list[dict], columns: list[str]) -> None:
    """One row per result, the columns that any result has; '-' where one lacks it."""
    columns = [c for c in columns if any(c in r for r in results)]
    cells = [[_cell(r.get(c, "-")) for c in columns] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    if len(results) >= 2 and all("output_tok_s" in r for r in results):
        first = results[0]
        for other in results[1:]:
            print(f"{first['system']} / {other['system']}: output tok/s x"
                  f"{first['output_tok_s'] / other['output_tok_s']:.2f}")
