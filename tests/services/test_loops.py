"""The three back-end services as real processes over the real Redis, driven by a test api.

Greedy float32 outputs, prefix caching on, must equal the in-process Engine's token for token: on the happy
path, and when the worker, the kvstore or the scheduler is killed with SIGKILL in the
middle of generation and restarted (recompute from prompt + tokens so far; for the
scheduler, the api resubmits). Aborts (by the api, or because the api's heartbeat expired)
end a request with "abort". After each test the kvstore holds no block and passes its
integrity check.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from pagedserve.shared.messages import SamplingParams
from pagedserve.shared.streams import FIELD
from tests.services.conftest import MODULES, REPO, TestApi, start_backend, wait_for

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
]
SHORT = SamplingParams(max_tokens=16, temperature=0.0)
LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
ANCHOR = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)  # runs until aborted


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(prompt_ids, engine_f32) -> dict[str, list[list[int]]]:
    """The in-process engine's greedy tokens for LONG, and for SHORT the same cut at its
    max_tokens or after the first EOS (greedy picks the same tokens whatever the stopping
    rule). Computed before the stack starts, so the two do not share the CPU."""
    engine = engine_f32
    long = [o.token_ids for o in engine.generate(prompt_ids, LONG)]
    eos = set(engine.eos_token_ids)
    short = []
    for tokens in long:
        tokens = tokens[:SHORT.max_tokens]
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        short.append(tokens if stop is None else tokens[:stop + 1])
    return {"short": short, "long": long}


@pytest.fixture(scope="module")
def stack(reference, tmp_path_factory):
    """Prefix caching on: the prompts share the chat template's system prompt."""
    backend = start_backend(tmp_path_factory.mktemp("stack"), args={"kvstore": ["--enable-prefix-caching"]})
    yield backend
    backend.close()


@pytest.fixture
def api(stack):
    client = TestApi(stack)
    yield client
    client.close()


def _run_with_crash(stack, api, prompt_ids, reference, service: str) -> None:
    """Submit LONG requests and an anchor that cannot finish before the kill (so the kill lands
    mid-generation however fast the machine), SIGKILL `service` once tokens flow, restart it, finish."""
    kv_before = stack.stats("kvstore") or {}
    ids = [api.submit(p, LONG) for p in prompt_ids]
    anchor = api.submit(prompt_ids[0], ANCHOR)
    preemptions_before = stack.stats("scheduler")["num_preemptions_total"]
    api.wait(lambda: sum(len(api.outputs[r].token_ids) for r in ids) >= 2, 120, "first tokens")
    stack.kill(service)
    stack.start(service)
    if service == "scheduler":
        api.drain()  # the dead scheduler's last deltas are all on the stream by now
        assert anchor in api.resubmit_unfinished()
    outputs = api.wait_finished(ids, timeout=180)
    assert [o.finish_reason for o in outputs] == ["length"] * len(ids)
    assert [o.token_ids for o in outputs] == reference["long"]
    long = len(reference["long"][0])
    api.wait(lambda: len(api.outputs[anchor].token_ids) >= long, 120, "the anchor's tokens")
    assert api.outputs[anchor].token_ids[:long] == reference["long"][0]
    api.abort(anchor)
    api.wait_finished([anchor], timeout=60)
    stack.wait_kvstore_clean(since=kv_before)
    if service != "scheduler":  # the scheduler preempted its running requests to recompute them
        wait_for(lambda: stack.stats("scheduler")["num_preemptions_total"] > preemptions_before, 10,
                 "the scheduler to count the preemptions")


def test_outputs_match_the_in_process_engine(stack, api, prompt_ids, reference):
    kv_before = stack.stats("kvstore") or {}
    ids = [api.submit(p, SHORT) for p in prompt_ids]
    outputs = api.wait_finished(ids)
    assert [o.token_ids for o in outputs] == reference["short"]
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    stats = stack.wait_kvstore_clean(since=kv_before)
    assert stats["num_blocks"] == 256
    assert stats["prefix_cache_hits"] > kv_before.get("prefix_cache_hits", 0)
    num_tokens = sum(len(t) for t in reference["short"])
    wait_for(lambda: (s := stack.stats("scheduler"))["num_requests_running"] == s["num_requests_waiting"] == 0
             and s["generation_tokens_total"] >= num_tokens, 10, "the scheduler's stats to show it idle")


def test_abort_of_a_running_request_frees_its_blocks(stack, api, prompt_ids):
    kv_before = stack.stats("kvstore") or {}
    request_id = api.submit(prompt_ids[0], SamplingParams(max_tokens=2000, ignore_eos=True))
    api.wait(lambda: api.outputs[request_id].token_ids, 60, "the first token")
    api.abort(request_id)
    (output,) = api.wait_finished([request_id], timeout=60)
    assert output.finish_reason == "abort"
    assert 0 < len(output.token_ids) < 2000
    stack.wait_kvstore_clean(since=kv_before)


def test_abort_of_an_unknown_request_is_ignored(stack, api, prompt_ids, reference):
    api.abort("no-such-request")
    (output,) = api.wait_finished([api.submit(prompt_ids[1], SHORT)])
    assert output.token_ids == reference["short"][1]


def test_requests_of_a_silent_api_go_on(stack, prompt_ids):
    # an api without heartbeat (restarting, or cut off by a Redis restart) is not "lost":
    # its requests run to their end, their deltas wait on its stream
    silent = TestApi(stack, heartbeat_ttl_ms=300)  # never refreshed: expires at once
    kv_before = stack.stats("kvstore") or {}
    request_id = silent.submit(prompt_ids[0], SamplingParams(max_tokens=48, ignore_eos=True))
    (output,) = silent.wait_finished([request_id], timeout=120)
    assert output.finish_reason == "length" and len(output.token_ids) == 48
    stack.wait_kvstore_clean(since=kv_before)


def test_garbage_on_every_stream_ends_no_loop(stack, api, prompt_ids, reference):
    keys = stack.keys
    kv_before = stack.stats("kvstore") or {}
    for stream in (keys.requests, keys.kv_alloc, keys.kv_reply, keys.worker_plan("0"), keys.worker_results,
                   keys.worker_hello):
        stack.redis.xadd(stream, {FIELD: b"\xc1 not msgpack"})
        stack.redis.xadd(stream, {b"other": b"no payload field"})
    (output,) = api.wait_finished([api.submit(prompt_ids[2], SHORT)])
    assert output.token_ids == reference["short"][2]
    assert all(proc.poll() is None for proc in stack.procs.values())
    stack.wait_kvstore_clean(since=kv_before)


def test_worker_killed_mid_generation(stack, api, prompt_ids, reference):
    _run_with_crash(stack, api, prompt_ids, reference, "worker")


def test_kvstore_killed_mid_generation(stack, api, prompt_ids, reference):
    _run_with_crash(stack, api, prompt_ids, reference, "kvstore")


def test_scheduler_killed_mid_generation(stack, api, prompt_ids, reference):
    _run_with_crash(stack, api, prompt_ids, reference, "scheduler")


@pytest.mark.parametrize(("service", "args", "field"), [
    ("scheduler", ["--max-num-seqs", "0"], "max_num_seqs"),
    ("scheduler", ["--policy", "nope"], "policy"),
    ("kvstore", ["--watermark", "1.5"], "watermark"),
    ("kvstore", ["--log-level", "LOUD"], "log_level"),
    ("worker", ["--dtype", "float64"], "dtype"),
])
def test_bad_config_fails_at_start_naming_the_field(service, args, field):
    proc = subprocess.run([sys.executable, "-m", MODULES[service], "--prefix", "unused", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"'{field}'" in proc.stderr


def test_sigterm_stops_each_service_cleanly(stack):
    """Last in the module: it stops the stack."""
    for service in ("scheduler", "worker", "kvstore"):
        assert stack.kill(service, signal.SIGTERM) == 0
        assert stack.incarnation(service) is None  # its heartbeat is gone at once
