"""The CPU KV pool's pages faulted in while the worker is idle: a first write costs a fault, on a VM
with fresh memory a wait on the host too. A low-priority thread MADV_POPULATE_WRITEs the pool (contents
unchanged) in block-id order, the kvstore's, a chunk at a time once no step ran for IDLE_AFTER_S."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from pagedserve.shared.meminfo import MIN_AVAILABLE, available_memory

log = logging.getLogger("pagedserve.worker")

MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL and the pool is left lazy
PAGE = 4096
CHUNK = 2 << 20  # one huge page of one layer's K or V half a call
IDLE_AFTER_S = 0.2  # no step for this long: the worker is idle, not between steps
POLL_S = 0.05


def chunk_ranges(tensors: list[torch.Tensor], chunk: int = CHUNK) -> Iterator[tuple[int, int]]:
    """(address, length) page-aligned ranges covering each [2, num_blocks, ...] tensor's K and V halves,
    lowest block ids first across all layers."""
    halves = [(t.data_ptr() + h * t.nbytes // 2, t.nbytes // 2) for t in tensors for h in range(2)]
    longest = max((n for _a, n in halves), default=0)
    for offset in range(0, longest, chunk):
        for address, nbytes in halves:
            if offset >= nbytes:
                continue
            start = (address + offset) // PAGE * PAGE
            stop = -(-(address + min(offset + chunk, nbytes)) // PAGE) * PAGE
            yield start, stop - start


class PoolPrefault:
    """Marks steps (busy()) and, from its own thread, populates the pool while none runs."""

    def __init__(self, pool: object, tensors: list[torch.Tensor], idle_after_s: float = IDLE_AFTER_S):
        self._pool = weakref.ref(pool)  # the thread stops once the pool is gone; it never keeps it alive
        self._ranges = list(chunk_ranges(tensors))
        self._idle_after_s = idle_after_s
        self._in_step = 0
        self._last_step = time.monotonic()
        self.done = threading.Event()
        self.num_populated = 0

    def step_started(self) -> None:
        self._in_step += 1

    def step_ended(self) -> None:
        self._in_step -= 1
        self._last_step = time.monotonic()

    def start(self) -> threading.Thread | None:
        """The populating thread, started; None (pool left lazy) where madvise is not there."""
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return None
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        thread = threading.Thread(target=self._run, args=(madvise,), name="kv-prefault", daemon=True)
        thread.start()
        return thread

    def _idle(self) -> bool:
        return self._in_step == 0 and time.monotonic() - self._last_step >= self._idle_after_s

    def _run(self, madvise) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        started = time.perf_counter()
        for address, length in self._ranges:
            while not self._idle():
                if self._pool() is None:
                    return
                time.sleep(POLL_S)
            pool = self._pool()  # held across the call: the mapping cannot go away beneath it
            if pool is None:
                return
            available = available_memory()
            if available is not None and available < MIN_AVAILABLE + length:
                log.info("KV pool left to fault in at first use: %d MiB available", available >> 20)
                return
            if madvise(address, length, MADV_POPULATE_WRITE) != 0:
                log.info("KV pool left to fault in at first use: madvise: %s", os.strerror(ctypes.get_errno()))
                return
            del pool
            self.num_populated += 1
        log.info("KV pool faulted in while idle (%.1f s)", time.perf_counter() - started)
        self.done.set()
