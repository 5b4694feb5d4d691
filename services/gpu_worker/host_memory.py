"""Host memory for the CPU worker: big temporaries kept mapped (resident size stays at its
high-water mark), the randomly read KV pool on huge pages."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap

import torch

log = logging.getLogger("pagedserve.worker")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
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
    """A zeroed CPU tensor on its own anonymous mapping, advised onto transparent huge pages (where
    madvise mode allows). The kernel zero-fills each page at its first touch, so nothing is written
    here: a pool of gigabytes costs no start time, and memory is taken as blocks are first used."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # one huge page more, so the view can start on a huge-page boundary
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while the tensor lives
    offset = -raw.data_ptr() % HUGE_PAGE  # a multiple of the base page: mappings start on one
    with contextlib.suppress(OSError, AttributeError, ValueError):
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)  # ordinary pages without it: slower, same results
    return raw[offset : offset + nbytes].view(dtype).view(shape)
