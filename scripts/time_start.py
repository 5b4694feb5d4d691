"""Times `pagedserve up` from launch to its first streamed token, with each service's start.

    python3 scripts/time_start.py [--runs 5] [--port 8765] [--log FILE] [-- extra `pagedserve up` arguments]

Each run starts the whole stack (embedded Redis unless REDIS_URL), waits for "pagedserve ready",
streams one greedy chat completion, notes when its first token arrives, then stops the stack. It
prints one JSON line per run, then a summary: the median over the warm runs (all but the first,
which may build the caches: weights, kernels, tokenizer) of the time to ready and to the first
token, and of the timeline (when, after launch, each service logged that it was up) and of the
worker's phases (wall and CPU seconds). CPU seconds are the figures to trust on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx

PHASE = re.compile(r"startup phase (\w+) done in ([\d.]+) s \(CPU ([\d.]+) s\)")
WORKER_START = re.compile(r"worker ready: .*; start ([\d.]+) s \(CPU ([\d.]+) s\)")  # the whole process
# timeline event -> the first output line that marks it (seconds after launch, as the line arrives)
MARKS = {
    "redis": "embedded redis ready at",
    "kvstore": "kvstore ready:",
    "scheduler": "scheduler ready:",
    "api_listening": "api listening on",
    "api_connected": "connected: deltas on",
    "worker_ready": "worker ready: model=",
    "worker_joined": "ready: said hello",
    "ready": "pagedserve ready at",
}


def one_run(port: int, extra: list[str], log_path: str | None = None) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", "up", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    timeline: dict[str, float] = {}
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            for event, mark in MARKS.items():
                if event not in timeline and mark in line:
                    timeline[event] = round(time.monotonic() - start, 2)
            if line.startswith("pagedserve ready at"):
                ready.set()
        ready.set()  # `up` ended: the wait below must not run out its time

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(600) or "ready" not in timeline:
            raise RuntimeError("`pagedserve up` was not ready (it exited, or 600 s passed):\n" + "\n".join(lines[-30:]))
        t_ready = time.monotonic() - start
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                "temperature": 0, "stream": True}
        t_first = None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content") and t_first is None:
                        t_first = time.monotonic() - start
        phases = {m.group(1): [float(m.group(2)), float(m.group(3))] for m in map(PHASE.search, lines) if m}
        for m in filter(None, map(WORKER_START.search, lines)):
            phases["total"] = [float(m.group(1)), float(m.group(2))]
        return {"ready_s": round(t_ready, 2), "first_token_s": round(t_first, 2), "timeline_s": timeline,
                "worker_phases_s_cpu": phases}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
        if log_path:
            with open(log_path, "a") as f:
                f.write("\n".join(lines) + "\n")


def summary(runs: list[dict]) -> dict:
    """Medians over the warm runs (all but the first when there are several)."""
    warm = runs[1:] if len(runs) > 1 else runs

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    events = [e for e in MARKS if any(e in r["timeline_s"] for r in warm)]
    phases = [p for r in warm for p in r["worker_phases_s_cpu"]]
    return {
        "warm_runs": len(warm),
        "ready_s": med(r["ready_s"] for r in warm),
        "first_token_s": med(r["first_token_s"] for r in warm),
        "timeline_s": {e: med(r["timeline_s"].get(e) for r in warm) for e in events},
        "worker_phases_s": {p: med(r["worker_phases_s_cpu"].get(p, [None])[0] for r in warm)
                            for p in dict.fromkeys(phases)},
        "worker_phases_cpu_s": {p: med(r["worker_phases_s_cpu"].get(p, [0, None])[1] for r in warm)
                                for p in dict.fromkeys(phases)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--log", default=None, help="append every run's `pagedserve up` output to this file")
    args, extra = parser.parse_known_args()
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.port, [a for a in extra if a != "--"], args.log))
        print(json.dumps({"run": i + 1, **runs[-1]}), flush=True)
    result = summary(runs)
    print(json.dumps({"summary": result}), flush=True)
    print(f"warm start to first token: {result['first_token_s']} s (ready {result['ready_s']} s), median of "
          f"{result['warm_runs']} warm run(s)", flush=True)
    print("  after launch: " + ", ".join(f"{e} {s} s" for e, s in result["timeline_s"].items()), flush=True)
    print("  worker phases: " + ", ".join(f"{p} {s} s (CPU {result['worker_phases_cpu_s'][p]} s)"
                                          for p, s in result["worker_phases_s"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
