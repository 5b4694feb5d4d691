"""Waiting on conditions in tests: poll with a deadline, never a fixed sleep."""

from __future__ import annotations

import time


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll condition() until it returns something truthy; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
