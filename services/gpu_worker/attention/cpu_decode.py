"""The CPU decode kernel (cpu_decode.cpp): built on first use, None where it cannot be.

Built with torch's cpp_extension (g++ and ninja, both installed with the project) into
torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), once per
machine: later processes load the cached build, and torch's file lock lets several worker
processes start at once. -march=native: the build is for the machine that runs it.
-ffast-math is on the compile line only (so the exp loop uses glibc's vector expf); the
link line does not get it, so crtfastmath is not linked and the process keeps IEEE
denormals (the rest of the model must still match HF transformers bit for bit in float32).

PAGEDSERVE_CPU_KERNELS=0 turns it off (the torch path then decodes with SDPA). A build or
load failure is logged once and also leaves the torch path in charge, so a machine without
a compiler still serves, only slower.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("pagedserve.worker")

SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") not in ("0", "false", "no")


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (with paged_decode_attention), or None."""
    if not enabled():
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load(name="pagedserve_cpu_decode", sources=[str(SOURCE)],
                                  extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a build error: serve on the torch path
        log.warning("CPU decode kernel unavailable (%s: %s); decoding with SDPA", type(e).__name__, e)
        return None
