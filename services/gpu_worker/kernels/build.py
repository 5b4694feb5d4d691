"""`pagedserve build-kernels`: compile every CPU kernel ahead of the first start; exit 1 if any fails."""

from __future__ import annotations

import argparse
import time

from services.gpu_worker.kernels import cpu_extensions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", nargs="+", choices=sorted(cpu_extensions.SOURCES), default=None,
                        help="build only these kernels (default: all)")


def run(args: argparse.Namespace) -> int:
    if not cpu_extensions.enabled():
        print("CPU kernels are off (PAGEDSERVE_CPU_KERNELS=0): nothing to build")
        return 0
    names = args.only or list(cpu_extensions.SOURCES)
    print(f"CPU kernels: cache {cpu_extensions.build_dir(names[0]).parent} (TORCH_EXTENSIONS_DIR moves it)",
          flush=True)
    failed = []
    for name in names:
        if cpu_extensions.is_built(name):
            print(f"  {name:<9} cached", flush=True)
            cpu_extensions.load(name)
            continue
        print(f"  {name:<9} building {cpu_extensions.SOURCES[name].name} ...", flush=True)
        start = time.monotonic()
        ok = cpu_extensions.load(name) is not None
        print(f"  {name:<9} {'built' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s", flush=True)
        if not ok:
            failed.append(name)
    if failed:
        print(f"not built: {', '.join(failed)} (the worker uses plain torch ops for those; see the warnings above)")
        return 1
    return 0
