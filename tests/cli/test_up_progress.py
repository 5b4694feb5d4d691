"""While `pagedserve up` waits, it names what each worker is doing: the latest "startup phase:"
line of the worker's own output."""

from __future__ import annotations

import sys

from pagedserve.services.launcher.supervisor import Child, Supervisor
from pagedserve.services.launcher.up import workers_doing
from tests.services.conftest import wait_for


def test_up_names_each_workers_latest_phase():
    sup = Supervisor()
    script = ("print('12:00 INFO pagedserve.worker: startup phase: importing torch');"
              "print('12:01 INFO pagedserve.worker: startup phase imports done in 1.00 s (CPU 0.90 s)');"
              "print('12:01 INFO pagedserve.worker: startup phase: loading the model')")
    for name, code in (("worker0", script), ("worker1", "print('no phase yet')"), ("api", script)):
        sup.start(Child(name, [sys.executable, "-c", code], forward=False))
    try:
        wait_for(lambda: all(c.returncode() is not None for c in sup.children), 60, "the children to finish")
        assert workers_doing(sup) == "worker0: loading the model"
    finally:
        sup.stop_all(grace_s=5)
