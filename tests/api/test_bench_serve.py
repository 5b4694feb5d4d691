"""`pagedserve bench serve` against the real stack: the command, its JSON, its figures.

No timing is asserted (timing belongs in benchmarks): only that every request came back
with exactly its max_tokens (greedy, ignore_eos), and that the summary is well formed.
"""

from __future__ import annotations

import json

import pytest

from pagedserve.services.cli import main

pytestmark = pytest.mark.slow

WORKLOAD = [{"prompt_token_ids": list(range(1000, 1000 + n)), "max_tokens": m}
            for n, m in [(5, 3), (40, 6), (17, 1), (70, 9), (33, 4), (5, 12)]]


def test_bench_serve_measures_the_stack(stack_api, tmp_path, capsys):
    """The command runs in this process (its output is what is checked), as `pagedserve bench` would."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "results.json"
    code = main(["bench", "serve", "--url", stack_api.base_url, "--workload", str(workload), "--request-rate", "20",
                 "--max-concurrency", "4", "--output", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stdout + stderr
    (result,) = json.loads(out.read_text())
    assert result["num_failed"] == 0
    assert result["num_requests"] == len(WORKLOAD)
    assert result["output_tokens"] == sum(w["max_tokens"] for w in WORKLOAD)
    assert result["prompt_tokens"] == sum(len(w["prompt_token_ids"]) for w in WORKLOAD)
    for name in ("ttft", "itl", "e2e", "tpot"):
        assert 0 < result[f"{name}_p50_ms"] <= result[f"{name}_p99_ms"]
    assert 0 < result["peak_kv_usage"] <= 1
    assert "ttft_p99_ms" in stdout  # the table
