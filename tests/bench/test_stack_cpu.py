"""StackCpu.per_step: CPU per step from two snapshots, and nothing when the step count is unknown."""

from __future__ import annotations

from pagedserve.services.bench.stack_cpu import StackCpu

BASE = 1_795_751_404_000_000  # step ids start at a wall-clock base (microseconds) when a worker joins


def snap(step_id: int | None, **cpu_s: float) -> dict:
    return {"cpu_s": cpu_s, "step_id": step_id}


def test_cpu_per_step_is_the_cpu_used_over_the_steps_between_the_snapshots():
    before, after = snap(BASE + 10, api=1.0, scheduler=2.0), snap(BASE + 110, api=1.5, scheduler=2.2)
    assert StackCpu.per_step(before, after) == {"steps": 100, "cpu_ms_per_step_api": 5.0,
                                                "cpu_ms_per_step_scheduler": 2.0}


def test_no_figures_from_a_snapshot_taken_before_the_first_step():
    """step_id 0 (stats written before any step) would count the wall-clock base as steps."""
    assert StackCpu.per_step(snap(0, api=1.0), snap(BASE + 110, api=1.5)) == {}
    assert StackCpu.per_step(snap(None, api=1.0), snap(BASE + 110, api=1.5)) == {}
    assert StackCpu.per_step(snap(BASE + 110, api=1.0), snap(BASE + 110, api=1.5)) == {}
