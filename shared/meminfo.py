"""The host's available memory, for work that fills memory ahead of its use."""

from __future__ import annotations

MIN_AVAILABLE = 1 << 30  # filling ahead stops while the host has less memory available than this


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
