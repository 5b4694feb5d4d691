"""Waiting in tests: on conditions (poll with a deadline, never a fixed sleep) and on processes."""

from __future__ import annotations

import signal
import subprocess
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


def stop_process(proc: subprocess.Popen, timeout: float, sig: int = signal.SIGTERM) -> None:
    """Send sig, wait up to timeout for the exit, then SIGKILL."""
    stop_processes([proc], timeout, sig)


def stop_processes(procs: list[subprocess.Popen], timeout: float, sig: int = signal.SIGTERM) -> None:
    """Send sig to all at once, wait up to timeout for each exit, then SIGKILL: they wind down
    together, so stopping several takes the longest one's time, not their sum."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
