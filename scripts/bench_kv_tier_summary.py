"""The table of scripts/bench_kv_tier.sh's results: random-64 output tok/s tier on / off per pair
(goal: on within 3% of off), and the eviction workload's rounds 2-3 TTFT p50 and cached prefix
share for tier on, tier off and vLLM-CPU with the same pool. Usage: python3 THIS OUTDIR"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def served_tok_s(path: Path) -> float:
    """Output tok/s of the stack's row (the first result of `bench serve --output`)."""
    return json.loads(path.read_text())[0]["output_tok_s"]


def main(out: Path) -> None:
    ratios = []
    for i in (1, 2, 3):
        on, off = (out / f"cost-{t}-{i}.json" for t in ("2GiB", "0"))
        if on.exists() and off.exists():
            a, b = served_tok_s(on), served_tok_s(off)
            ratios.append(a / b)
            print(f"random-64 pair {i}: tier on {a:.1f} out tok/s, off {b:.1f}, on/off {a / b:.3f}")
    if ratios:
        print(f"random-64 on/off median {statistics.median(ratios):.3f} (goal >= 0.97)")
    for name in ("2GiB", "0", "vllm"):
        path = out / f"evict-{name}.json"
        if path.exists():
            later = json.loads(path.read_text())["later_rounds"]
            print(f"eviction {name}: rounds 2-3 TTFT p50 {later['ttft_p50_s']} s, "
                  f"prefix cached {100 * later['prefix_cached_frac']:.1f} %")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench-kv-tier"))
