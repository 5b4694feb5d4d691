"""The pagedserve modules whose code runs, in each service process of a real stack, for one
POST /v1/completions from the route to the worker and back: the count a reader of one
request's path meets. Any checkout can be measured the same way (point PYTHONPATH at it).

    python3 scripts/stack_request_modules.py [--model smollm2] [--port 8031] [--stream] [--entries]

It starts `pagedserve up` with a sitecustomize on PYTHONPATH that installs a profile hook in
every process (off until SIGUSR1, dumped on SIGUSR2), warms the stack with one request, then
records one more and prints each service's modules and the union.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx

HOOK = '''
import json, os, signal, sys, threading
_out = os.environ.get("PAGEDSERVE_TRACE_MODULES")
if _out:
    _seen, _on = {}, [False]

    def _hook(frame, event, _arg):
        if _on[0] and event == "call":
            name = frame.f_globals.get("__name__", "")
            if name.startswith("pagedserve.") and name not in _seen:
                back = frame.f_back
                caller = back.f_globals.get("__name__", "?") + ":" + back.f_code.co_name if back else "?"
                _seen[name] = caller + " -> " + frame.f_code.co_name

    def _start(*_):
        _seen.clear()
        _on[0] = True

    def _dump(*_):
        _on[0] = False
        with open(os.path.join(_out, "%d.json" % os.getpid()), "w") as f:
            json.dump({"argv": sys.argv, "modules": sorted(_seen), "entries": _seen}, f)

    sys.setprofile(_hook)
    threading.setprofile(_hook)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
'''
SERVICES = ("api", "scheduler", "kvstore", "gpu_worker")


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def service_of(argv: list[str]) -> str | None:
    joined = " ".join(argv)
    return next((s for s in SERVICES if f"services.{s}." in joined or f"services/{s}/" in joined), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--entries", action="store_true", help="also how each module was first entered (from where)")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="request-modules-"))
    (work / "hook").mkdir()
    (work / "hook" / "sitecustomize.py").write_text(HOOK)
    (work / "out").mkdir()
    env = {**os.environ, "PAGEDSERVE_TRACE_MODULES": str(work / "out"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "hook"), os.environ.get("PYTHONPATH")]))}
    env.pop("REDIS_URL", None)  # embedded Redis: nothing shared with other runs
    up = subprocess.Popen([sys.executable, "-m", "pagedserve.services.cli", "up", "--model", args.model,
                           "--port", str(args.port)], env=env, stdout=open(work / "up.log", "w"),
                          stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    body = {"model": args.model, "prompt": "The capital of France is", "max_tokens": 8, "stream": args.stream}
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or up.poll() is not None:
                sys.exit(f"stack did not start: see {work / 'up.log'}")
            time.sleep(1)
        while httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 503:  # warm
            if time.monotonic() > deadline:
                sys.exit("no worker became ready")
            time.sleep(1)
        pids = [pid for pid in descendants(up.pid) if service_of(cmdline(pid))]  # not Redis: USR1 ends it
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        time.sleep(1.0)  # the finish's frees and records settle after the response
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        dumps = {pid: work / "out" / f"{pid}.json" for pid in pids}
        deadline = time.monotonic() + 10
        while not all(p.exists() for p in dumps.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
    union: set[str] = set()
    for path in dumps.values():
        if not path.exists():
            continue
        dump = json.loads(path.read_text())
        service = service_of(dump["argv"])
        if service is None or not dump["modules"]:
            continue
        union.update(dump["modules"])
        print(f"{service}: {len(dump['modules'])} modules: {' '.join(m[11:] for m in dump['modules'])}")
        if args.entries:
            for module in dump["modules"]:
                print(f"    {module[11:]:45} {dump['entries'][module].replace('pagedserve.', '')}")
    print(f"all services: {len(union)} distinct modules")


if __name__ == "__main__":
    main()
