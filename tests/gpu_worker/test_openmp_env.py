"""The worker's OpenMP environment: its team size, and an idle spin short enough to sleep between
steps, unless the operator chose a wait policy or a spin count."""

from __future__ import annotations

from pagedserve.services.gpu_worker.main import SPIN_COUNT, openmp_env


def test_the_worker_sets_a_short_spin_and_the_team_size():
    env: dict[str, str] = {}
    openmp_env(env, 3)
    assert env == {"OMP_NUM_THREADS": "3", "GOMP_SPINCOUNT": SPIN_COUNT}
    env = {}
    openmp_env(env, None)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}


def test_an_operators_policy_or_count_wins():
    env = {"GOMP_SPINCOUNT": "300000"}
    openmp_env(env, None)
    assert env == {"GOMP_SPINCOUNT": "300000"}
    env = {"OMP_WAIT_POLICY": "active"}
    openmp_env(env, 2)
    assert env == {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "2"}
