"""The in-process benchmark commands run end to end on the real model, called in this process as
`pagedserve bench` would be (tiny sizes; no timing is asserted, only that they complete, count
exactly and write their JSON)."""

from __future__ import annotations

import json

import pytest

from pagedserve.services.cli import main

pytestmark = pytest.mark.slow


def _bench(capsys, *argv: str) -> str:
    """Runs `pagedserve bench ARGV` in this process (its output is what is checked, and torch and
    the model's imports are paid once); its exit code must be 0; returns what it printed."""
    capsys.readouterr()
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    return out


def test_throughput_on_a_json_workload(tmp_path, capsys):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": [500 + i for i in range(n)], "max_tokens": m}
                                    for n, m in [(9, 3), (30, 5), (17, 1)]]))
    out = tmp_path / "r.json"
    _bench(capsys, "throughput", "--workload", str(workload), "--dtype", "float32", "--output", str(out))
    (result,) = json.loads(out.read_text())
    assert result["system"] == "pagedserve-inprocess"
    assert (result["output_tokens"], result["prompt_tokens"], result["num_requests"]) == (9, 56, 3)
    assert result["ttft_p50_ms"] > 0 and result["itl_p50_ms"] > 0


def test_latency_in_process(tmp_path, capsys):
    out = tmp_path / "r.json"
    stdout = _bench(capsys, "latency", "--prompt-len", "20", "--output-len", "4", "--repeat", "2", "--dtype",
                    "float32", "--output", str(out))
    (result,) = json.loads(out.read_text())
    assert result["runs"] == 2 and result["prompt_len"] == 20
    assert 0 < result["ttft_min_ms"] <= result["ttft_median_ms"]
    assert 0 < result["per_token_min_ms"] <= result["per_token_median_ms"]
    assert "per_token_median_ms" in stdout


def test_latency_times_verification_steps_against_a_plain_one(tmp_path, capsys):
    out = tmp_path / "r.json"
    _bench(capsys, "latency", "--prompt-len", "20", "--output-len", "5", "--repeat", "1", "--dtype", "float32",
           "--draft-tokens", "3,1", "--output", str(out))
    results = json.loads(out.read_text())
    assert [r["draft_tokens"] for r in results] == [0, 1, 3]
    assert [r["system"] for r in results] == [f"pagedserve-inprocess ({k} drafts a step)" for k in (0, 1, 3)]
    assert results[0]["step_cost_x"] == 1.0 and all(r["per_step_median_ms"] > 0 for r in results)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_lists_the_step_and_the_cpu_kernels(tmp_path, capsys, dtype):
    from pagedserve.services.gpu_worker.kernels import cpu_extensions

    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": [600 + i for i in range(n)], "max_tokens": 6}
                                    for n in (12, 40)]))
    out = tmp_path / "p.json"
    stdout = _bench(capsys, "profile", "--workload", str(workload), "--dtype", dtype, "--skip-steps", "2", "--steps", "3",
                  "--output", str(out))
    report = json.loads(out.read_text())
    assert report["num_running"] == 2 and report["step_ms"] > 0
    names = {row["name"] for row in report["rows"]}
    # two rows a step: on AVX-512 BF16 the bf16 projections run in cpu_gemv (gemv.linear_q4)
    assert any("linear" in name or "aten::mm" in name or "addmm" in name for name in names)
    if cpu_extensions.load("decode") is not None:  # two decodes per step: the kernel runs each layer
        kernel = next(row for row in report["rows"] if row["name"] == "kernel.paged_decode_attention")
        assert kernel["calls_per_step"] == 30  # SmolLM2's layers
    if dtype == "bfloat16" and cpu_extensions.load("fused") is not None:
        assert "fused.silu_and_mul" in names
    assert "ms per step" in stdout
