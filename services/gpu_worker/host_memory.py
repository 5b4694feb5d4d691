"""Host memory for the CPU worker: big temporaries kept mapped, the KV pool on huge pages.

keep_freed_memory: keep freed host memory mapped, so a step's big temporaries do not
page-fault again.
A CPU step allocates tens of MB of activations and logits, and frees them at the end. By
default glibc serves every block over its mmap threshold (128 KiB, adapting up to 32 MiB)
with a fresh mmap and unmaps it on free: the next step page-faults the same memory in
again, one 4 KiB page at a time. Converting a decode step's [128, 49152] logits to float32
took 3.1 ms that way and 1.5 ms with the settings below (a copy into a tensor already
mapped: 0.7 ms). The cost: the worker's resident size stays at its high-water mark, which
is what a serving process has anyway (vLLM's CPU backend asks for tcmalloc for the same
reason).

huge_pages_zeros: the KV pool is read at random, one 6 KiB block here and another there,
several hundred MB per decode step; on 4 KiB pages nearly every block costs a TLB miss and
a page walk. Backed by 2 MiB transparent huge pages (madvise, before the first touch) the
pool covers a few thousand TLB entries instead of a few hundred thousand.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

log = logging.getLogger("pagedserve.worker")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def keep_freed_memory() -> bool:
    """Serve big blocks from the heap and never trim it; False where libc is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 1 << 31) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.info("mallopt unavailable: big temporaries are mapped afresh every step")
    return ok


def huge_pages_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the kernel is asked to back with huge pages (where
    transparent huge pages are enabled for madvise; elsewhere an ordinary zeroed tensor)."""
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    # over-allocate by one huge page so the view can start on a huge-page boundary
    raw = torch.empty(numel * itemsize + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(numel * itemsize), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass  # ordinary pages: slower, same results
    tensor = raw[offset : offset + numel * itemsize].view(dtype).view(shape)
    return tensor.zero_()  # first touch after the advice; zeros: no slot may hold NaN
