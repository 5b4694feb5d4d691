"""`pagedserve up --workers 2 --router round-robin` with the offload tier, end to end (float32):
a 2,000-token prefix computed on one worker is loaded, not computed, by the other, which
reports cached_tokens of at least 1,984 (every full block but the one holding the last token)
and gives the same greedy text."""

from __future__ import annotations

import signal
import subprocess
import uuid

import httpx
import msgpack
import pytest
import redis

from pagedserve.shared.streams import Keys
from tests.cli.helpers import REDIS_URL, START_TIMEOUT_S, base_env, free_port, pagedserve_argv, wait_for
from tests.services.conftest import delete_prefix
from tests.waiting import stop_process

pytestmark = pytest.mark.slow

PREFIX_TOKENS = 2000


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    prefix, port = f"test-{uuid.uuid4().hex[:12]}", free_port()
    log_path = tmp_path_factory.mktemp("tier-two-workers") / "up.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    argv = [*pagedserve_argv(), "up", "--workers", "2", "--router", "round-robin", "--dtype", "float32",
            "--num-blocks", "400", "--port", str(port), "--prefix", prefix, "--ready-timeout", str(START_TIMEOUT_S)]
    proc = subprocess.Popen(argv, env=base_env(REDIS_URL=REDIS_URL, PAGEDSERVE_CHECK_INTEGRITY="1"), stdout=log,
                            stderr=subprocess.STDOUT)

    def ready():
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            raise RuntimeError(f"pagedserve up exited with {proc.returncode}:\n{text[-4000:]}")
        return "pagedserve ready at" in text

    try:
        wait_for(ready, START_TIMEOUT_S + 30, "pagedserve up --workers 2 to be ready")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600.0) as client:
            yield client, Keys(prefix)
    finally:
        stop_process(proc, 60, signal.SIGINT)
        log.close()
        delete_prefix(prefix)


def test_the_second_worker_loads_the_prefix_the_first_computed(up):
    client, keys = up
    prompt = [100 + (i * 104729) % 30000 for i in range(PREFIX_TOKENS)]
    bodies = [client.post("/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                                                   "temperature": 0}) for _ in range(2)]
    assert [b.status_code for b in bodies] == [200, 200], bodies[-1].text
    first, second = (b.json() for b in bodies)
    cached = [(b["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for b in (first, second)]
    assert cached[0] == 0 and cached[1] >= PREFIX_TOKENS - 16
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    r = redis.Redis.from_url(REDIS_URL)
    scheduler = msgpack.unpackb(r.get(keys.stats("scheduler")), raw=False)
    kvstore = msgpack.unpackb(r.get(keys.stats("kvstore")), raw=False)
    r.close()
    computed = sorted(w["prompt_tokens_computed_total"] for w in scheduler["workers"].values())
    assert computed == [PREFIX_TOKENS - cached[1], PREFIX_TOKENS]  # round robin: one worker each
    assert kvstore["prefix_cache_tier_hits"] == cached[1]
