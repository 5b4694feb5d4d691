"""Times `pagedserve up` from launch to its first streamed token, with the worker's start phases.

    python3 scripts/time_start.py [--runs 3] [--port 8765] [-- extra `pagedserve up` arguments]

Each run starts the whole stack (embedded Redis unless REDIS_URL), waits for "pagedserve ready",
streams one greedy chat completion, notes when its first token arrives, then stops the stack. The
first run after a change of model, dtype, code or CPU builds the weight cache; later ones are warm.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

PHASE = re.compile(r"startup phase (\w+) done in ([\d.]+) s \(CPU ([\d.]+) s\)")


def one_run(port: int, extra: list[str]) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", "up", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("pagedserve ready at"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(600):
            raise RuntimeError("not ready in 600 s:\n" + "\n".join(lines[-30:]))
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
        phases = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in map(PHASE.search, lines) if m}
        return {"ready_s": round(t_ready, 2), "first_token_s": round(t_first, 2), "worker_phases_s_cpu": phases}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--port", type=int, default=8765)
    args, extra = parser.parse_known_args()
    for i in range(args.runs):
        print(json.dumps({"run": i + 1, **one_run(args.port, [a for a in extra if a != "--"])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
