"""run_service's stop is bounded: a main() that ignores the stop event still ends the
process with exit 0 (and its stuck task's stack in the log) soon after SIGTERM, so a
supervisor never needs SIGKILL; settle_gc tunes a started service's collector."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STUCK_SERVICE = """
import asyncio, sys
from pagedserve.shared import redis_io
redis_io.STOP_GRACE_S = 0.5

async def main(stop):
    print("ready", flush=True)
    await asyncio.sleep(3600)  # never looks at `stop`

sys.exit(redis_io.run_service(main, "stuck"))
"""


def test_a_service_that_ignores_sigterm_still_exits_cleanly():
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", STUCK_SERVICE], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "did not stop within" in err and "in main" in err, err  # the stuck task's stack


def test_settle_gc_freezes_the_startup_and_raises_the_young_threshold():
    code = ("import gc\nfrom pagedserve.shared import redis_io\nbefore = gc.get_threshold()\nredis_io.settle_gc()\n"
            "print(gc.get_freeze_count() > 1000, gc.get_threshold() == (redis_io.GC_YOUNG_THRESHOLD, *before[1:]))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True, capture_output=True, timeout=60)
    assert done.stdout.split() == ["True", "True"], done.stderr
