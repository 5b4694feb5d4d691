"""The CPU kernels in C++, built on first use; None where they cannot be.

- decode (../attention/cpu_decode.cpp): paged decode attention straight from the block pool,
  float32 or bfloat16.
- prefill (../attention/cpu_prefill.cpp): paged causal prefill attention, bfloat16, where the
  CPU has AVX-512 BF16 (its supported() says so; elsewhere SDPA keeps the prefills).
- fused (cpu_fused.cpp): RMSNorm, residual add + RMSNorm, SwiGLU and rotary, bf16 or
  float32, each one pass over memory, rounding as torch's op chains do.
- gemv (cpu_gemv.cpp): few-row bf16 linears (bf16 weights, GGUF Q4_1 and Q8_0 blocks),
  AVX-512 BF16.
- gemv_f32 (cpu_gemv_f32.cpp): few-row float32 linears on GGUF Q4_1 and Q8_0 blocks, AVX2.

Built with torch's cpp_extension (g++ and ninja, both installed with the project) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), once per
machine: later processes load the cached build. `pagedserve build-kernels` (scripts/install.sh
and the Dockerfile run it) builds them all ahead of the first start; a worker that must build
says so first ("building CPU kernels ..."). A stamp beside each build (source, headers,
compile line, torch version) tells a cached build from one that must be made. Several processes starting at once take
turns on an flock, which also clears the lock file torch leaves when a build is killed.
torch rebuilds when a source or the compile line changes; the headers a source includes
(HEADERS) are hashed onto its compile line so that editing one rebuilds too.
-march=native: the build is for the machine that runs it (its AVX-512 and AVX2 paths
compile only where the CPU has them; elsewhere portable loops); a digest of the CPU's
feature flags is on the compile line, so a cache built on another CPU (an image built
elsewhere) is rebuilt, not run.
-ffast-math is on the compile line only (so exp loops use glibc's vector expf); the link
line does not get it, so crtfastmath is not linked and the process keeps IEEE denormals
(float32 results stay within an ulp of torch's, and greedy output matches HF transformers).

PAGEDSERVE_CPU_KERNELS=0 turns them off (the torch path then runs plain torch ops). A
build or load failure is logged once and also leaves plain torch in charge, so a machine
without a compiler still serves, only slower.
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
           "gemv_f32": HERE / "cpu_gemv_f32.cpp"}
# headers a source includes: torch rebuilds when a source or the compile line changes, not a
# header, so their hash goes on the compile line
HEADERS = {"decode": [ATTENTION / "cpu_decode_work.h", ATTENTION / "cpu_decode_simd.h"],
           "gemv": [HERE / "cpu_tiling.h"], "gemv_f32": [HERE / "cpu_tiling.h"]}


@functools.cache
def cpu_digest() -> str:
    """A digest of this CPU's feature flags (what -march=native compiles for)."""
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
    """A build of this source, headers, compile line and torch is in the cache."""
    marker = build_dir(name) / "pagedserve.stamp"
    return marker.exists() and marker.read_text() == _stamp(name)


@functools.cache
def _say_building() -> None:
    log.warning("building CPU kernels (first start, ~2 min; cached in %s for later starts; "
                "`pagedserve build-kernels` does this ahead)...", build_dir("fused").parent)


@functools.cache
def load(name: str):
    """The compiled module `name` (a key of SOURCES), or None."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        directory = build_dir(name)
        with _exclusive(directory / "pagedserve.flock"):
            # torch's own lock is a plain file that a process killed mid-build leaves behind,
            # and every later load would wait on it for ever. Holding our flock (the kernel
            # drops it with its holder), no live process of ours is building: clear it.
            (directory / "lock").unlink(missing_ok=True)
            built, start = is_built(name), time.monotonic()
            if not built:
                _say_building()
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
