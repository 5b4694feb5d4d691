"""The C++ CPU kernels (SOURCES), built once per machine into torch's extension cache; load() gives None
where they cannot be built or PAGEDSERVE_CPU_KERNELS=0, and plain torch ops serve instead.
-ffast-math compiles but does not link, so the process keeps IEEE denormals.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("pagedserve.worker")

HERE = Path(__file__).parent
ATTENTION = HERE.parent / "attention"
SOURCES = {"decode": ATTENTION / "cpu_decode.cpp", "prefill": ATTENTION / "cpu_prefill.cpp",
           "fused": HERE / "cpu_fused.cpp", "gemv": HERE / "cpu_gemv.cpp",
           "gemv_f32": HERE / "cpu_gemv_f32.cpp", "head_argmax": HERE / "cpu_head_argmax.cpp",
           "sample": HERE / "cpu_sample.cpp"}
# torch rebuilds on a source or compile-line change only, so these headers' hash goes on the compile line
HEADERS = {"decode": [ATTENTION / "cpu_decode_work.h", ATTENTION / "cpu_decode_bf16.h",
                      ATTENTION / "cpu_decode_simd.h", ATTENTION / "cpu_decode_int8.h",
                      ATTENTION / "cpu_decode_int8_avx512.h", ATTENTION / "cpu_kv_int8.h"],
           "prefill": [ATTENTION / "cpu_kv_int8.h", ATTENTION / "cpu_prefill_layout.h",
                       ATTENTION / "cpu_prefill_softmax.h", ATTENTION / "cpu_prefill_f32.h"],
           "fused": [ATTENTION / "cpu_kv_int8.h"],
           "gemv": [HERE / "cpu_tiling.h", HERE / "cpu_gemv_amx.h", HERE / "cpu_gemv_wide.h", HERE / "cpu_gemv_q8.h"],
           "gemv_f32": [HERE / "cpu_tiling.h", HERE / "cpu_f32_tiles.h"], "head_argmax": [HERE / "cpu_f32_tiles.h"]}


@functools.cache
def cpu_digest() -> str:
    """A digest of this CPU's feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


def compile_flags(name: str) -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
    headers = HEADERS.get(name, [])
    if headers:
        digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:16]
        flags.append(f"-DPAGEDSERVE_HEADERS_HASH={digest}")
    flags.append(f"-DPAGEDSERVE_CPU={cpu_digest()}")  # a cache from another CPU is rebuilt
    return flags


@contextlib.contextmanager
def _exclusive(path: Path):
    """An flock on path for the block: one builder per machine, released if its holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") not in ("0", "false", "no")


def build_dir(name: str) -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(f"pagedserve_cpu_{name}", verbose=False))


def _stamp(name: str) -> str:
    import torch

    parts = [SOURCES[name].read_bytes(), *(h.read_bytes() for h in HEADERS.get(name, [])),
             " ".join(compile_flags(name)).encode(), torch.__version__.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def is_built(name: str) -> bool:
    marker = build_dir(name) / "pagedserve.stamp"
    return marker.exists() and marker.read_text() == _stamp(name)


@functools.cache
def _say_building() -> None:
    log.warning("building CPU kernels (first start, ~2 min; cached in %s for later starts; "
                "`pagedserve build-kernels` does this ahead)...", build_dir("fused").parent)


def _import_built(name: str, directory: Path):
    """The stamped build's .so, without ninja: the stamp keys the sources' content, where ninja's
    rules key their path, so a checkout elsewhere (a clean clone) would recompile; None if unloadable."""
    import importlib.util

    import torch  # noqa: F401  (loads the libraries the .so links to)

    module_name = f"pagedserve_cpu_{name}"
    try:
        spec = importlib.util.spec_from_file_location(module_name, directory / f"{module_name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, AttributeError):
        return None
    return module


@functools.cache
def load(name: str):
    """The compiled module `name` (a key of SOURCES), or None."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        directory = build_dir(name)
        with _exclusive(directory / "pagedserve.flock"):
            # torch's plain lock file survives a killed build; under our flock nobody is building
            (directory / "lock").unlink(missing_ok=True)
            built, start = is_built(name), time.monotonic()
            if not built:
                _say_building()
            module = _import_built(name, directory) if built else None
            if module is None:
                module = cpp_extension.load(name=f"pagedserve_cpu_{name}", sources=[str(SOURCES[name])],
                                            build_directory=str(directory), extra_cflags=compile_flags(name),
                                            extra_ldflags=["-fopenmp"], verbose=False)
            if not built:
                (directory / "pagedserve.stamp").write_text(_stamp(name))
                log.info("built CPU kernel %r in %.0f s", name, time.monotonic() - start)
            return module
    except Exception as e:  # no compiler, no ninja, a build error: serve on plain torch
        log.warning("CPU kernels %r unavailable (%s: %s); using plain torch ops", name, type(e).__name__, e)
        return None
