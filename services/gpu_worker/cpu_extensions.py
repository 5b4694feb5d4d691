"""The CPU kernels in C++, built on first use; None where they cannot be.

- decode (attention/cpu_decode.cpp): paged decode attention straight from the block pool,
  float32 or bfloat16.
- fused (cpu_fused.cpp): bf16 RMSNorm, residual add + RMSNorm, SwiGLU and rotary, each
  one pass over memory, rounding as torch's op chains do.

Built with torch's cpp_extension (g++ and ninja, both installed with the project) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), once per
machine: later processes load the cached build, and torch's file lock lets several worker
processes start at once. -march=native: the build is for the machine that runs it (its
AVX-512 paths compile only where the CPU has AVX-512; elsewhere portable loops).
-ffast-math is on the compile line only (so exp loops use glibc's vector expf); the link
line does not get it, so crtfastmath is not linked and the process keeps IEEE denormals
(the float32 model must still match HF transformers bit for bit).

PAGEDSERVE_CPU_KERNELS=0 turns them off (the torch path then runs plain torch ops). A
build or load failure is logged once and also leaves plain torch in charge, so a machine
without a compiler still serves, only slower.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("pagedserve.worker")

HERE = Path(__file__).parent
SOURCES = {"decode": HERE / "attention" / "cpu_decode.cpp", "fused": HERE / "cpu_fused.cpp"}


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") not in ("0", "false", "no")


@functools.cache
def load(name: str):
    """The compiled module `name` (a key of SOURCES), or None."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name=f"pagedserve_cpu_{name}", sources=[str(SOURCES[name])],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a build error: serve on plain torch
        log.warning("CPU kernels %r unavailable (%s: %s); using plain torch ops", name, type(e).__name__, e)
        return None
