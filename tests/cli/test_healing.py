"""The launcher's healing, fast: the restart policy's delays and give-up, and Supervisor.heal()
restarting real child processes, counting and publishing restarts, and giving up on one that
keeps crashing with its last log lines kept."""

from __future__ import annotations

import sys

from pagedserve.services.launcher.restart_policy import RestartPolicy
from pagedserve.services.launcher.supervisor import Child, Supervisor
from tests.waiting import wait_for


def test_delays_double_up_to_the_cap_then_give_up():
    policy = RestartPolicy(first_s=0.5, cap_s=3.0, max_restarts=5, window_s=100.0)
    assert [policy.on_death(t) for t in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, None]


def test_a_child_that_stays_up_for_the_window_starts_over():
    policy = RestartPolicy(first_s=1.0, cap_s=30.0, max_restarts=2, window_s=60.0)
    assert (policy.on_death(0.0), policy.on_death(10.0)) == (1.0, 2.0)
    assert policy.on_death(65.0) == 2.0  # the death at 0 is out of the window, the one at 10 is not
    assert policy.on_death(200.0) == 1.0 and policy.recent_deaths == 1


def _child(name: str, code: str) -> Child:
    return Child(name, [sys.executable, "-c", code], forward=False)


def test_heal_restarts_the_dead_and_publishes_counts():
    published: list[dict[str, int]] = []
    sup = Supervisor(publish=published.append, policy=lambda: RestartPolicy(first_s=0.01, max_restarts=3))
    steady = sup.start(_child("steady", "import time; time.sleep(60)"))
    flaky = sup.start(_child("flaky", "import sys; print('once', flush=True); sys.exit(3)"))
    try:
        wait_for(lambda: flaky.returncode() == 3, 10, "flaky to exit")
        first_pid = flaky.pid

        def restarted():
            assert sup.heal() is None
            return sup.restarts.get("flaky") == 1

        wait_for(restarted, 10, "flaky to be restarted", interval=0.02)
        assert flaky.pid != first_pid and steady.returncode() is None and "steady" not in sup.restarts
        assert published[-1] == {"steady": 0, "flaky": 1}
    finally:
        sup.stop_all(grace_s=2.0)


def test_heal_gives_up_on_a_child_that_keeps_crashing():
    sup = Supervisor(policy=lambda: RestartPolicy(first_s=0.01, max_restarts=2, window_s=60.0))
    crashing = sup.start(_child("crashing", "import sys; print('bad config: --model', flush=True); sys.exit(2)"))
    try:
        gave_up = wait_for(lambda: sup.heal(), 20, "the supervisor to give up", interval=0.02)
        assert gave_up is crashing and sup.restarts == {"crashing": 2} and crashing.returncode() == 2
        assert crashing.tail(5)[-1] == "bad config: --model"
    finally:
        sup.stop_all(grace_s=2.0)


def test_restart_counts_reach_the_metrics_as_one_series_per_service():
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.services.api.metrics import ApiMetrics

    def restarts(snapshot: dict) -> dict[str, float]:
        families = text_string_to_metric_families(ApiMetrics().render(snapshot).decode())
        family = next(f for f in families if f.name == "pagedserve:service_restarts")
        return {s.labels["service"]: s.value for s in family.samples}

    assert restarts({"launcher": {"restarts": {"worker": 2, "api": 0}}}) == {"worker": 2.0, "api": 0.0}
    assert restarts({}) == {}  # not under `pagedserve up`: the family, no series
