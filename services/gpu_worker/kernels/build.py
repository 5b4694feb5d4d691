"""`pagedserve build-kernels`: compile every CPU kernel ahead of the first start; exit 1 if any fails.
Kernels not yet cached build in child processes, one per core, since each compile is single-threaded."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pagedserve.services.gpu_worker.kernels import cpu_extensions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="+", choices=sorted(cpu_extensions.SOURCES), default=None,
                        help="build only these kernels (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="kernels compiled at once (default: the number of cores)")


def _build_one(name: str) -> tuple[str, bool, float, str]:
    """Compiles `name` in a child process: (name, built, seconds, the child's output)."""
    start = time.monotonic()
    child = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "build-kernels", "--only", name,
                            "--jobs", "1"], capture_output=True, text=True)
    return name, child.returncode == 0, time.monotonic() - start, child.stdout + child.stderr


def run(args: argparse.Namespace) -> int:
    if not cpu_extensions.enabled():
        print("CPU kernels are off (PAGEDSERVE_CPU_KERNELS=0): nothing to build")
        return 0
    if args.jobs < 1:
        print(f"--jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    names = args.only or list(cpu_extensions.SOURCES)
    print(f"CPU kernels: cache {cpu_extensions.build_dir(names[0]).parent} (TORCH_EXTENSIONS_DIR moves it)",
          flush=True)
    missing = [name for name in names if not cpu_extensions.is_built(name)]
    if len(missing) > 1 and args.jobs > 1:
        print(f"  building {', '.join(missing)} ({args.jobs} at a time) ...", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            for name, ok, seconds, output in pool.map(_build_one, missing):
                print(f"  {name:<9} {'built' if ok else 'FAILED'} in {seconds:.0f} s", flush=True)
                if not ok:
                    print(output, flush=True)
    failed = []
    for name in names:
        cached = cpu_extensions.is_built(name)
        if not cached:
            print(f"  {name:<9} building {cpu_extensions.SOURCES[name].name} ...", flush=True)
        start = time.monotonic()
        ok = cpu_extensions.load(name) is not None
        if cached:
            print(f"  {name:<9} cached", flush=True)
        else:
            print(f"  {name:<9} {'built' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s", flush=True)
        if not ok:
            failed.append(name)
    if failed:
        print(f"not built: {', '.join(failed)} (the worker uses plain torch ops for those; see the warnings above)")
        return 1
    return 0
