"""`bench serve --launch --model X` serves X (the stack and the in-process baseline run the
same model) and reports each service's CPU per step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.shared.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """One random Llama layer with SmolLM2's vocabulary and tokenizer, as an HF directory."""
    path = tmp_path_factory.mktemp("tiny-hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    load_tokenizer("smollm2").hf.save_pretrained(path)
    return path


def test_launch_serves_the_model_asked_for_and_reports_cpu_per_step(tiny_model, tmp_path):
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps([{"prompt_token_ids": [500 + i for i in range(n)], "max_tokens": m}
                                    for n, m in [(9, 6), (30, 5), (17, 4)]]))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "bench", "serve", "--launch", "--model", str(tiny_model),
                           "--workload", str(workload), "--dtype", "float32", "--baseline", "inprocess",
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stack, inprocess = json.loads(out.read_text())
    assert stack["system"] == "pagedserve-stack" and stack["model"] == str(tiny_model)
    assert inprocess["system"] == "pagedserve-inprocess"
    assert stack["num_failed"] == 0 and stack["output_tokens"] == inprocess["output_tokens"] == 15
    assert stack["steps"] >= 2  # the longest: its prefill, then its other 5 tokens in one multi-step plan
    # /proc counts CPU in clock ticks (10 ms): a few steps of the kvstore or scheduler may
    # round to 0, while the api and the worker always spend more than that
    for service in ("api", "scheduler", "kvstore", "gpu_worker"):
        assert stack[f"cpu_ms_per_step_{service}"] >= 0
    assert stack["cpu_ms_per_step_api"] > 0 and stack["cpu_ms_per_step_gpu_worker"] > 0


def test_latency_through_the_stack_reports_cpu_per_token(tiny_model, tmp_path):
    out = tmp_path / "l.json"
    proc = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "bench", "latency", "--launch", "--model",
                           str(tiny_model), "--prompt-len", "20", "--output-len", "6", "--repeat", "2", "--dtype",
                           "float32", "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(out.read_text())
    assert result["system"] == "pagedserve-stack" and result["runs"] == 2
    assert result["steps"] >= 2 * 2  # a prefill and a plan of 5 decode steps, the warm-up's too
    # clock ticks of 10 ms: one service's few ms may round to 0, never all of them
    per_service = [result[f"cpu_ms_per_step_{s}"] for s in ("api", "scheduler", "kvstore", "gpu_worker")]
    assert min(per_service) >= 0 and sum(per_service) > 0
    assert "cpu_ms_per_step_scheduler" in proc.stdout
