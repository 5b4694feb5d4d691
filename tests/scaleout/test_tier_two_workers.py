"""`pagedserve up --workers 2 --router round-robin` with the offload tier, end to end (float32):
a 1,000-token prefix computed on one worker is loaded, not computed, by the other, which
reports cached_tokens of at least 984 (every full block but the one holding the last token)
and gives the same greedy text; after a kill -9 of a worker while 8 requests of 500-token prompts
generate, its requests resume elsewhere from their blocks in the tier (each recomputes at most one
block, a counter shows it) with the text of a fault-free run, and no block or pin is leaked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import pytest
import redis

from pagedserve.shared.streams import Keys
from tests.cli.helpers import REDIS_URL, START_TIMEOUT_S, base_env, free_port, pagedserve_argv, wait_for
from tests.services.conftest import delete_prefix
from tests.waiting import stop_process

pytestmark = pytest.mark.slow

PREFIX_TOKENS = 1000
MOVED_PROMPT_TOKENS = 500
MOVED_OUTPUT_TOKENS = 48


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    prefix, port = f"test-{uuid.uuid4().hex[:12]}", free_port()
    log_path = tmp_path_factory.mktemp("tier-two-workers") / "up.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    # 400 blocks: the survivor holds all 8 of the kill test's requests (35 blocks each);
    # 512-token steps and a long step timeout: a slow shared machine must not reset the workers
    argv = [*pagedserve_argv(), "up", "--workers", "2", "--router", "round-robin", "--dtype", "float32",
            "--num-blocks", "400", "--max-num-batched-tokens", "512", "--step-timeout", "300", "--port", str(port), "--prefix", prefix, "--ready-timeout", str(START_TIMEOUT_S)]
    proc = subprocess.Popen(argv, env=base_env(REDIS_URL=REDIS_URL, PAGEDSERVE_CHECK_INTEGRITY="1"), stdout=log,
                            stderr=subprocess.STDOUT)

    def ready():
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            raise RuntimeError(f"pagedserve up exited with {proc.returncode}:\n{text[-4000:]}")
        return "pagedserve ready at" in text

    try:
        wait_for(ready, START_TIMEOUT_S + 30, "pagedserve up --workers 2 to be ready")
        # ready may come with one worker joined: round robin over one would place both requests there
        wait_for(lambda: len(stats(Keys(prefix), "scheduler").get("workers", {})) == 2, START_TIMEOUT_S,
                 "both workers to join the scheduler")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600.0) as client:
            yield client, Keys(prefix), log_path
    finally:
        stop_process(proc, 60, signal.SIGINT)
        log.close()
        delete_prefix(prefix)


def test_the_second_worker_loads_the_prefix_the_first_computed(up):
    client, keys, _log = up
    prompt = [100 + (i * 104729) % 30000 for i in range(PREFIX_TOKENS)]
    bodies = [client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0}) for _ in range(2)]
    assert [b.status_code for b in bodies] == [200, 200], bodies[-1].text
    first, second = (b.json() for b in bodies)
    cached = [(b["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for b in (first, second)]
    assert cached[0] == 0 and cached[1] >= PREFIX_TOKENS - 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    expected = [PREFIX_TOKENS - cached[1], PREFIX_TOKENS]  # round robin: one worker each

    def computed() -> list[int]:
        return sorted(w["prompt_tokens_computed_total"] for w in stats(keys, "scheduler")["workers"].values())

    # each service writes its stats a moment after a step: wait until the counts (they only grow) add up
    wait_for(lambda: sum(computed()) >= sum(expected), 30, "the scheduler's stats to count both prompts")
    wait_for(lambda: stats(keys, "kvstore").get("prefix_cache_tier_hits", 0) >= cached[1], 30,
             "the kvstore's stats to count the tier hits")
    assert computed() == expected
    assert stats(keys, "kvstore")["prefix_cache_tier_hits"] == cached[1]


def stats(keys: Keys, service: str) -> dict:
    r = redis.Redis.from_url(REDIS_URL)
    data = r.get(keys.stats(service))
    r.close()
    return msgpack.unpackb(data, raw=False) if data is not None else {}


def running_on(keys: Keys, worker_id: str) -> int | None:
    """Requests the scheduler runs on this worker; None once it left (a stopped worker's lease
    expires after 5 s: its requests then resume as after a kill)."""
    lane = stats(keys, "scheduler").get("workers", {}).get(worker_id)
    return None if lane is None else lane["num_requests_running"]


def test_kill_9_of_a_worker_resumes_its_requests_from_the_tier(up):
    """8 requests of 500-token prompts, 4 on each worker; one worker is killed while all 8 are
    generating. Each of its requests resumes on the survivor recomputing at most one block, under
    async scheduling (the default): a block that fills before the kvstore knows its last token is
    hashed and written by the worker (a tier fill), and no token after it is known before it is."""
    client, keys, log_path = up
    prompts = [[100 + (i * 7919 + j * 104729) % 30000 for j in range(MOVED_PROMPT_TOKENS)] for i in range(8)]

    streamed = [0] * len(prompts)  # chunks each request of the current run has received

    def run_all(salt: str, max_tokens: int = MOVED_OUTPUT_TOKENS) -> list[str]:
        def one(i):
            body = {"model": "smollm2", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "cache_salt": salt, "stream": True}
            parts = []
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
                        streamed[i] += 1
            return "".join(parts)

        streamed[:] = [0] * len(prompts)
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, range(len(prompts))))

    reference = run_all("reference")  # another salt: nothing of it is the faulted run's cache
    # the faulted run's prompts prefilled first: its 8 requests then all start decoding within a step
    # or two, instead of one worker finishing its 4 while the other still prefills (a race on the kill)
    run_all("faulted", max_tokens=1)
    before = stats(keys, "scheduler")
    pids = {m.group(1): int(m.group(2)) for m in re.finditer(r"started (worker\d) \(pid (\d+)\)",
                                                               log_path.read_text(errors="replace"))}
    victim = pids[sorted(pids)[0]]
    victim_id = next(w for w in before["workers"] if w.endswith(f"-{victim}"))  # a worker's id: hostname-pid
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_all, "faulted")

        def all_generating():  # each past its prompt: its blocks in the tier
            return min(streamed) >= 3

        wait_for(all_generating, 900, "all 8 requests to be generating")
        # stopped, the victim finishes nothing until its kill: the check below holds at the kill,
        # however late this thread sees it (a count of streamed chunks may already be over)
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_for(lambda: running_on(keys, victim_id) in (4, None), 60,
                     "the stopped worker's 4 requests unfinished in the scheduler's stats")
        finally:
            os.kill(victim, signal.SIGKILL)
        texts = future.result(timeout=900)
    assert texts == reference
    after = stats(keys, "scheduler")
    gained = {key: after[key] - before[key] for key in (
        "num_resumed_total", "num_resumed_recomputed_tokens_total", "num_resumed_over_one_block_total",
        "num_tier_missed_blocks_total")}
    # the killed worker's 4 (the survivor has room for all 8: no preemption expected, none excluded)
    assert gained["num_resumed_total"] >= 4, gained
    assert gained["num_resumed_over_one_block_total"] == 0 and gained["num_tier_missed_blocks_total"] == 0, gained
    assert gained["num_resumed_recomputed_tokens_total"] <= 16 * gained["num_resumed_total"], gained

    def clean():
        kv = stats(keys, "kvstore")
        ok = kv.get("num_held_blocks") == 0 and kv.get("integrity_ok") and kv.get("tier_num_pinned") == 0
        return kv if ok else None

    wait_for(clean, 120, "the kvstore to hold no block and pin no tier entry")
