"""Host memory for the CPU worker: big temporaries kept mapped (resident size stays at its
high-water mark), the randomly read KV pool on huge pages."""

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
    """A zeroed CPU tensor advised onto transparent huge pages (where madvise mode allows)."""
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
