"""Starting several workers: `pagedserve up --workers N` splits the cores and passes the
router's options; a worker's id defaults to <hostname>-<pid>; bad values fail at start
naming the field. And the multi-prefix bench workload's shape."""

from __future__ import annotations

import argparse
import os
import socket
from collections import Counter

import pytest

from pagedserve.services.bench.named_workloads import WORKLOADS
from pagedserve.services.gpu_worker import main as worker_main
from pagedserve.services.launcher import up
from pagedserve.services.scheduler import main as scheduler_main
from pagedserve.shared.config import ConfigError
from pagedserve.shared.scheduler_config import SchedulerConfig

REDIS = "redis://127.0.0.1:6379/0"


def _args(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_up_starts_n_workers_with_the_cores_split_between_them():
    args = _args(up, "--workers", "3", "--router", "round-robin", "--prefill-weight", "2.5")
    up.check_args(args)
    commands = dict(up.service_commands(args, REDIS))
    assert [name for name in commands if name.startswith("worker")] == ["worker0", "worker1", "worker2"]
    threads = max(1, len(os.sched_getaffinity(0)) // 3)
    for name in ("worker0", "worker1", "worker2"):
        argv = commands[name]
        assert argv[argv.index("--threads") + 1] == str(threads) and "--worker-id" not in argv  # ids unique by pid
    scheduler = " ".join(commands["scheduler"])
    assert "--router round-robin" in scheduler and "--prefill-weight 2.5" in scheduler
    assert "--decode-weight" not in scheduler


def test_one_worker_keeps_its_name_and_every_core_unless_told():
    commands = dict(up.service_commands(_args(up), REDIS))
    assert "worker" in commands and "--threads" not in commands["worker"]
    commands = dict(up.service_commands(_args(up, "--threads-per-worker", "2"), REDIS))
    assert commands["worker"][commands["worker"].index("--threads") + 1] == "2"


@pytest.mark.parametrize("argv, field", [(["--workers", "0"], "--workers"), (["--threads-per-worker", "0"],
                                                                             "--threads-per-worker"),
                                          (["--prefill-weight", "-1"], "prefill_weight"),
                                          (["--prefill-weight", "0", "--decode-weight", "0"], "decode_weight")])
def test_up_refuses_bad_values_naming_the_field(argv, field):
    with pytest.raises(ConfigError, match=field):
        up.check_args(_args(up, *argv))


def test_scheduler_validates_the_router_naming_the_field():
    with pytest.raises(ConfigError, match="'decode_weight'"):
        SchedulerConfig(decode_weight=float("nan"))
    assert scheduler_main.run(_args(scheduler_main, "--decode-weight", "nan")) == 2  # refused before any Redis
    with pytest.raises(ConfigError, match="'router'"):
        SchedulerConfig(router="random")
    assert SchedulerConfig(router="round-robin", prefill_weight=0.0).prefill_weight == 0.0


def test_worker_id_defaults_to_host_and_pid_and_bad_ones_are_refused():
    args = _args(worker_main)
    worker_main.check_worker_args(args)
    assert args.worker_id == f"{socket.gethostname()}-{os.getpid()}"
    for bad in ("", "a b", "a:b"):
        with pytest.raises(ConfigError, match="'worker_id'"):
            worker_main.check_worker_args(_args(worker_main, "--worker-id", bad))
    with pytest.raises(ConfigError, match="'threads'"):
        worker_main.check_worker_args(_args(worker_main, "--threads", "0"))


def test_multi_prefix_workload_shuffles_eight_long_prefixes():
    requests = WORKLOADS["multi-prefix-64"]()
    assert len(requests) == 64 and all(len(r["prompt_token_ids"]) == 544 and r["max_tokens"] == 32 for r in requests)
    prefixes = [tuple(r["prompt_token_ids"][:512]) for r in requests]
    assert sorted(Counter(prefixes).values()) == [8] * 8
    assert len({prefixes[i] for i in range(0, 64, 2)}) == 8  # round robin over 2 workers splits them
    assert sum(prefixes[i] != prefixes[i + 1] for i in range(63)) > 32  # interleaved, not grouped
    assert len({tuple(r["prompt_token_ids"]) for r in requests}) == 64
