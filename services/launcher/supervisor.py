"""Child processes for `pagedserve up`, each in its own process group (Ctrl-C reaches only the
supervisor, which stops them in order) with PR_SET_PDEATHSIG; output forwarded with a name tag.
A child that dies is restarted with backoff (restart_policy); one that keeps crashing is given up.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from pagedserve.services.launcher.restart_policy import RestartPolicy

log = logging.getLogger("pagedserve.up")

TAIL_LINES = 40
PUBLISH_EVERY_S = 10.0  # restart counts rewritten this often (a restarted Redis has lost them)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Child:
    """One child process: its own process group, output forwarded as "[name] line"."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
                 forward: bool = True) -> None:
        self.name, self.argv, self.env, self.forward = name, list(argv), env, forward
        self.proc: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            process_group=0, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._tail.append(line)
            if self.forward:
                sys.stdout.write(f"[{self.name}] {line}\n")
                sys.stdout.flush()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def returncode(self) -> int | None:
        """None while running, else the exit status (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 20) -> list[str]:
        if self._reader is not None and self.returncode() is not None:
            self._reader.join(timeout=1.0)  # let the last lines of a dead child arrive
        return list(self._tail)[-n:]

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float) -> bool:
        """True if the process ended within `timeout` seconds."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(timeout, 0.0))
            return True
        except subprocess.TimeoutExpired:
            return False


class Supervisor:
    """Children started in order and stopped in reverse order; heal() restarts the dead ones.
    `publish` receives {name: restarts so far} after each restart and every PUBLISH_EVERY_S."""

    def __init__(self, publish: Callable[[dict[str, int]], None] | None = None,
                 policy: Callable[[], RestartPolicy] = RestartPolicy) -> None:
        self.children: list[Child] = []
        self.publish, self.policy = publish, policy
        self.restarts: dict[str, int] = {}
        self._policies: dict[str, RestartPolicy] = {}
        self._due: dict[str, float] = {}  # name of a dead child -> when it restarts (monotonic)
        self._published_at = -PUBLISH_EVERY_S

    def heal(self, now: float | None = None) -> Child | None:
        """Restart each dead child once its backoff is over; the child that keeps crashing, if any
        (left dead: the caller stops the rest and shows its last lines)."""
        now = time.monotonic() if now is None else now
        changed = False
        for child in self.children:
            if child.returncode() is None:
                continue
            if child.name not in self._due:
                delay = self._policies.setdefault(child.name, self.policy()).on_death(now)
                if delay is None:
                    log.error("%s keeps crashing (exit %s, %d deaths within %.0f s): giving up", child.name,
                              child.returncode(), self._policies[child.name].recent_deaths,
                              self._policies[child.name].window_s)
                    return child
                self._due[child.name] = now + delay
                log.warning("%s exited with %s: restarting it in %.1f s", child.name, child.returncode(), delay)
            elif now >= self._due[child.name]:
                del self._due[child.name]
                child.start()
                self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
                log.warning("restarted %s (restart %d)", child.name, self.restarts[child.name])
                changed = True
        if self.publish is not None and (changed or now - self._published_at >= PUBLISH_EVERY_S):
            self._published_at = now
            self.publish({c.name: self.restarts.get(c.name, 0) for c in self.children})
        return None

    def start(self, child: Child) -> Child:
        child.start()
        self.children.append(child)
        return child

    def first_dead(self) -> Child | None:
        return next((c for c in self.children if c.returncode() is not None), None)

    def stop_all(self, grace_s: float = 15.0, force: threading.Event | None = None, last: Child | None = None) -> None:
        """SIGTERM children in reverse order, SIGKILL after `grace_s`; `last` (Redis) after the rest."""
        self._stop(
            [c for c in reversed(self.children) if c is not last], grace_s, force)
        if last is not None:
            self._stop([last], grace_s, force)
        for child in self.children:
            log.info("%s exited with %s", child.name, child.returncode())

    def _stop(self, children: list[Child], grace_s: float, force: threading.Event | None) -> None:
        alive = [c for c in children if c.returncode() is None]
        for child in alive:
            log.info("stopping %s (pid %d)", child.name, child.pid)
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in alive:
            while not child.wait(0.2):
                if time.monotonic() >= deadline or (force is not None and force.is_set()):
                    log.warning("%s did not stop in time: SIGKILL", child.name)
                    child.signal_group(signal.SIGKILL)
                    child.wait(5.0)
                    break
        for child in children:  # anything a child left behind in its group
            child.signal_group(signal.SIGKILL)

    def stop_one(self, child: Child, grace_s: float = 10.0) -> None:
        if child.returncode() is None:
            child.signal_group(signal.SIGTERM)
            if not child.wait(grace_s):
                child.signal_group(signal.SIGKILL)
                child.wait(5.0)
        child.signal_group(signal.SIGKILL)
