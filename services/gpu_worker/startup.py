"""The worker's start in named phases: each logged when it begins ("startup phase: <what>", the
line `pagedserve up` shows while it waits) and when it ends, with its time; then one summary.
No torch here: the launcher imports PHASE_MARK."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from pathlib import Path

log = logging.getLogger("pagedserve.worker")

PHASE_MARK = "startup phase: "


class StartupPhases:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}  # phase name -> seconds, in start order
        self.cpu_seconds: dict[str, float] = {}  # the same phases' CPU time, all threads (less noisy)
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str, doing: str):
        log.info("%s%s", PHASE_MARK, doing)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + time.process_time() - cpu
            log.info("startup phase %s done in %.2f s (CPU %.2f s)", name, self.seconds[name], self.cpu_seconds[name])

    def begin(self, doing: str) -> None:
        """A last step with no end of its own (joining the stack)."""
        log.info("%s%s", PHASE_MARK, doing)

    def summary(self) -> str:
        """'start 3.10 s (CPU 2.90 s): imports 1.20 s, model 0.90 s, ...' (CPU: since the process began)."""
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items())
        return f"start {time.perf_counter() - self.started:.2f} s (CPU {time.process_time():.2f} s): {parts}"


def _take(f, phases: StartupPhases, waiting: str, doing: str) -> bool:
    """flock f; True if another process held it, the wait logged as the phase `waiting`."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        with phases.phase(waiting, doing):
            fcntl.flock(f, fcntl.LOCK_EX)
        return True


@contextlib.contextmanager
def held_lock(path: Path, phases: StartupPhases, waiting: str, doing: str):
    """An flock on path for the block (waiting for another process's hold: the phase `waiting`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        waited = _take(f, phases, waiting, doing)
        try:
            yield waited
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def waited_for(path: Path, phases: StartupPhases, waiting: str, doing: str) -> bool:
    """Whether another process held path's flock (its release awaited as the phase `waiting`)."""
    with held_lock(path, phases, waiting, doing) as waited:
        return waited


def last_phase(lines: list[str]) -> str | None:
    """What the latest "startup phase: ..." line among a child's output lines says it is doing."""
    for line in reversed(lines):
        at = line.find(PHASE_MARK)
        if at >= 0:
            return line[at + len(PHASE_MARK):].strip()
    return None
