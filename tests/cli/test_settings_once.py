"""Each scheduler setting is defined once (shared/scheduler_config.py): `pagedserve scheduler`
takes its default from there, `pagedserve up` passes on what it is given, the engine and the
Scheduler core default to the same values, one validation names the field, and the README's
configuration table states the same defaults."""

from __future__ import annotations

import argparse
import inspect
import re
from dataclasses import fields
from pathlib import Path

import pytest

from pagedserve.services.launcher import up
from pagedserve.services.scheduler import main as scheduler_main
from pagedserve.services.scheduler.scheduler import Scheduler
from pagedserve.shared.config import ConfigError, EngineConfig
from pagedserve.shared.options import command_line, from_args
from pagedserve.shared.scheduler_config import DEFAULT_POLICY, SchedulerConfig, StepLimits

README = Path(__file__).resolve().parents[2] / "README.md"
NAMES = [f.name for f in fields(SchedulerConfig)]


def _parse(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_service_the_engine_and_the_core_share_each_default():
    defaults = SchedulerConfig()
    assert from_args(SchedulerConfig, _parse(scheduler_main)) == defaults
    engine = EngineConfig()
    assert [getattr(engine, f.name) for f in fields(StepLimits)] == [getattr(defaults, f.name)
                                                                     for f in fields(StepLimits)]
    core = inspect.signature(Scheduler).parameters
    shared = [name for name in NAMES if name in core]
    assert shared == ["max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "num_scheduler_steps",
                      "stream_interval", "max_waiting_requests", "max_waiting_tokens"]
    assert {name: core[name].default for name in shared} == {name: getattr(defaults, name) for name in shared}


def test_the_policy_and_speculation_defaults_are_one_for_every_command():
    from pagedserve.services.bench import throughput

    for module in (up, scheduler_main, throughput):
        args = _parse(module)
        assert (args.policy, args.speculative_config) == (DEFAULT_POLICY, None)
        assert args.policy_options in ("{}", {})
    engine = EngineConfig()
    assert (engine.policy, engine.policy_options, engine.speculative_config) == (DEFAULT_POLICY, {}, None)
    assert from_args(StepLimits, _parse(throughput)) == StepLimits()


def test_up_passes_on_exactly_the_settings_it_is_given_and_the_scheduler_reads_them_back():
    args = _parse(up, "--long-prefill-token-threshold", "0", "--no-async-scheduling", "--step-timeout", "5",
                  "--router", "round-robin")
    scheduler = dict(up.service_commands(args, "redis://127.0.0.1:6379/0"))["scheduler"]
    given = scheduler[scheduler.index("--policy-options") + 2:]
    assert given == ["--long-prefill-token-threshold", "0", "--no-async-scheduling", "--router", "round-robin",
                     "--step-timeout", "5.0"]
    read = from_args(SchedulerConfig, _parse(scheduler_main, *given))
    assert read == SchedulerConfig(long_prefill_token_threshold=0, async_scheduling=False, step_timeout=5.0,
                                   router="round-robin")
    assert from_args(SchedulerConfig, _parse(scheduler_main, *command_line(read, NAMES))) == read


@pytest.mark.parametrize("field, value", [("long_prefill_token_threshold", -1), ("max_num_seqs", 0),
                                          ("stream_interval", 0), ("step_timeout", 0.0), ("router", "random")])
def test_one_validation_names_the_field_wherever_the_value_comes_from(field, value):
    option = "--" + field.replace("_", "-")
    for make in (lambda: SchedulerConfig(**{field: value}),
                 lambda: up.check_args(_parse(up, option, str(value))),
                 lambda: from_args(SchedulerConfig, _parse(scheduler_main, option, str(value)))):
        with pytest.raises((ConfigError, SystemExit)) as info:  # argparse's choices refuse a router itself
            make()
        assert info.type is SystemExit or f"'{field}' ({option})" in str(info.value)
    if field in [f.name for f in fields(StepLimits)]:
        with pytest.raises(ConfigError, match=f"'{field}'"):
            EngineConfig(**{field: value})


def test_the_readme_states_the_defaults_the_code_has():
    defaults, checked = SchedulerConfig(), []
    for row in README.read_text().splitlines():
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if len(cells) < 4 or not cells[0].startswith("`--"):
            continue
        options = re.findall(r"`--([a-z-]+)`", cells[0])
        stated = re.findall(r"`([^`]+)`", cells[2])
        for option, text in zip(options, stated, strict=False):
            name = option.replace("-", "_")
            if name in NAMES:
                value = getattr(defaults, name)
                assert type(value)(text) == value, (option, text, value)
                checked.append(name)
    assert {"long_prefill_token_threshold", "router", "prefill_weight", "decode_weight", "stream_interval"} <= \
        set(checked)
