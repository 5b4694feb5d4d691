"""Reused host buffers for packing a step's tier stores (fresh memory faults every 4 KiB, costing
as much as the copy); taken on the compute thread, given back on the loop once written."""

from __future__ import annotations

import threading
from collections import deque

import torch


class PackBuffers:
    def __init__(self, row_bytes: int, max_free_bytes: int) -> None:
        if row_bytes < 1 or max_free_bytes < 0:
            raise ValueError(f"pack buffers need row_bytes >= 1 and max_free_bytes >= 0, got "
                             f"{row_bytes}, {max_free_bytes}")
        self.row_bytes, self.max_free_bytes = row_bytes, max_free_bytes
        self._lock = threading.Lock()  # take and give run on two threads
        self._free: deque[torch.Tensor] = deque()  # uint8 [rows, row_bytes]
        self.num_taken = 0  # packed, their writes not done
        self.num_allocated = 0

    def take(self, num_rows: int) -> torch.Tensor:
        """A buffer of at least num_rows rows; a free one that is too small is dropped for it."""
        with self._lock:
            buffer = self._free.pop() if self._free else None
            self.num_taken += 1
        if buffer is None or buffer.shape[0] < num_rows:
            buffer = torch.empty((num_rows, self.row_bytes), dtype=torch.uint8)
            self.num_allocated += 1
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.num_taken -= 1
            if buffer.numel() + self.free_bytes() <= self.max_free_bytes:
                self._free.append(buffer)

    def free_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._free)

    def check_integrity(self) -> None:
        assert self.num_taken >= 0, f"{-self.num_taken} pack buffers given back more often than taken"
        assert self.free_bytes() <= self.max_free_bytes, "free pack buffers over their budget"
        assert len({id(b) for b in self._free}) == len(self._free), "a pack buffer is free twice"
        assert all(b.dtype == torch.uint8 and b.shape[1] == self.row_bytes for b in self._free), "bad pack buffer"
