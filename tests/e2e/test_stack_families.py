"""Non-llama models through the whole stack: `pagedserve up --model DIR` on tiny random Qwen3 and
Gemma 3 folders (and a Gemma 3 GGUF) with their own tokenizers, chat templates and eos ids; a chat
completion through the api returns the text of transformers' greedy tokens, stopping on the eos
the model declares."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest

from tests.cli.helpers import REPO, START_TIMEOUT_S, base_env, free_port, pagedserve_argv, ready, wait_for
from tests.gpu_worker.family_checkpoints import GGUF_SHAPES, hf_greedy, save_servable
from tests.gpu_worker.family_gguf import write_gguf

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
QUESTIONS = ["List three fruits that are red.", "def f(x): return x ** 2", "What is the capital of France?"]
# family -> (seed, its eos ids, how transformers' answers to QUESTIONS end with that seed)
CASES = {"qwen3": (10, {0, 2}, ["stop", "stop", "length"]),
         "gemma3": (10, {1, 4}, ["length", "stop", "stop"])}  # Gemma: windows of 8 over ~40 tokens


def _expected(hf_model, hf_tokenizer, question: str, eos: set[int]) -> tuple[str, str]:
    """(text, finish_reason) of transformers' greedy answer, cut at the first eos id."""
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              return_dict=False)
    tokens = hf_greedy(hf_model, list(prompt), MAX_TOKENS)
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    if stop is not None:
        return hf_tokenizer.decode(tokens[:stop], skip_special_tokens=True), "stop"
    return hf_tokenizer.decode(tokens, skip_special_tokens=True), "length"


@pytest.mark.parametrize("name", sorted(CASES))
def test_up_serves_a_folder_as_transformers_would(tmp_path, name):
    seed, eos, reasons = CASES[name]
    hf_model, hf_tokenizer = save_servable(name, tmp_path / name, seed=seed)
    expected = [_expected(hf_model, hf_tokenizer, q, eos) for q in QUESTIONS]
    assert [reason for _, reason in expected] == reasons
    _serve_and_check(str(tmp_path / name), expected, tmp_path)


def test_up_serves_a_gemma3_gguf_as_transformers_would(tmp_path):
    """A Q8_0 Gemma 3 GGUF carrying its tokenizer, chat template and <end_of_turn> as eot id."""
    hf_model, hf_tokenizer = save_servable("gemma3", tmp_path / "folder", seed=10,
                                           **{**GGUF_SHAPES["gemma3"], "num_hidden_layers": 3})  # 3 sliding
    path = tmp_path / "gguf" / "gemma3.gguf"
    path.parent.mkdir()
    hf_model.load_state_dict(write_gguf(hf_model, path, "Q8_0", tokenizer=hf_tokenizer, eot_token_id=4), strict=False)
    expected = [_expected(hf_model, hf_tokenizer, q, {1, 4}) for q in QUESTIONS]
    assert [reason for _, reason in expected] == ["stop"] * 3
    _serve_and_check(str(path), expected, tmp_path)


def _serve_and_check(model_dir: str, expected: list[tuple[str, str]], tmp_path) -> None:
    """pagedserve up --model model_dir answers each of QUESTIONS with the expected (text, finish_reason)."""
    port = free_port()
    env = base_env(PAGEDSERVE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("REDIS_URL", None)
    proc = subprocess.Popen([*pagedserve_argv(), "up", "--model", model_dir, "--dtype", "float32",
                             "--num-blocks", "64", "--port", str(port), "--ready-timeout", str(START_TIMEOUT_S)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            process_group=0)
    base_url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, f"pagedserve up exited {proc.returncode}"
            return ready(base_url)

        wait_for(up, START_TIMEOUT_S + 10, "/ready of pagedserve up --model DIR")
        for question, (text, finish_reason) in zip(QUESTIONS, expected, strict=True):
            r = httpx.post(base_url + "/v1/chat/completions", timeout=120.0, json={
                "model": model_dir, "messages": [{"role": "user", "content": question}],
                "temperature": 0, "max_tokens": MAX_TOKENS})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (text, finish_reason)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
