"""`bench throughput --compare-prefix-caching`: one run, caching on then off, on the real
model (tiny sizes); only exact counts are asserted, never timing."""

from __future__ import annotations

import json

import pytest

from tests.bench.test_bench_commands import _bench

pytestmark = pytest.mark.slow


def test_the_same_workload_with_prefix_caching_on_and_off(tmp_path, capsys):
    stem = [700 + i for i in range(48)]  # three full blocks every request shares
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": stem + [100 + i] * 5, "max_tokens": 2} for i in range(3)]))
    out = tmp_path / "r.json"
    _bench(capsys, "throughput", "--workload", str(workload), "--dtype", "float32", "--compare-prefix-caching",
           "--output", str(out))
    on, off = json.loads(out.read_text())
    assert (on["system"], off["system"]) == ("pagedserve-inprocess (prefix caching on)",
                                             "pagedserve-inprocess (prefix caching off)")
    assert off["prompt_tokens_computed"] == off["prompt_tokens"] == 3 * 53
    # all three arrive at once: the first computes the stem, the other two find it cached
    # as soon as it is allocated in the same step
    assert on["prompt_tokens_computed"] == 53 + 2 * 5
    assert on["output_tokens"] == off["output_tokens"] == 6
