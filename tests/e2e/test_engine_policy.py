"""The in-process engine's scheduling policy comes from EngineConfig.policy/policy_options,
loaded through the `pagedserve.policies` entry points: a bad name or bad options fail at
start naming the field (before any weights load), and the chosen policy really orders the
work (sjf runs the short request first where fcfs runs the earlier, long one)."""

from __future__ import annotations

import pytest

from pagedserve.services.engine import Engine
from pagedserve.shared.config import ConfigError, EngineConfig
from pagedserve.shared.messages import SamplingParams

PROMPT = [1, 504, 3458, 282, 253, 1345, 30]  # any valid token ids: greedy, ignore_eos
LONG = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overrides,field", [
    ({"policy": "no-such-policy"}, "'policy'='no-such-policy'"),
    ({"policy": ""}, "'policy'=''"),
    ({"policy": "sjf", "policy_options": {"no_such_option": 1}}, "'policy'='sjf'"),
    ({"policy": "sjf", "policy_options": "aging=2"}, "'policy_options'"),
])
def test_a_bad_policy_fails_at_start_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        Engine(EngineConfig(dtype="float32", num_blocks=8, **overrides))
    assert str(info.value).startswith(f"invalid config field {field}")


def _finish_order(engine: Engine) -> list[str]:
    """Add LONG then SHORT before any step, one running slot: the ids in finishing order."""
    long_id = engine.add_request(PROMPT, LONG, request_id="long")
    short_id = engine.add_request(PROMPT, SHORT, request_id="short")
    order = []
    while engine.has_unfinished_requests():
        order += [d.request_id for d in engine.step() if d.finish_reason is not None]
    assert sorted(order) == sorted([long_id, short_id])
    return order


@pytest.mark.slow
def test_the_configured_policy_orders_the_engine():
    sjf = Engine(EngineConfig(dtype="float32", num_blocks=32, max_num_seqs=1, policy="sjf",
                              policy_options={"aging": 2}))
    assert sjf.scheduler.policy.describe() == {"name": "sjf", "options": {"aging": 2.0}}
    assert _finish_order(sjf) == ["short", "long"]
    fcfs = Engine(EngineConfig(dtype="float32", num_blocks=32, max_num_seqs=1))  # the default
    assert fcfs.scheduler.policy.name == "fcfs"
    assert _finish_order(fcfs) == ["long", "short"]


def test_bench_throughput_takes_the_policy(capsys):
    from pagedserve.services.cli import command_parser, main

    parser, _module = command_parser("bench")
    args = parser.parse_args(["throughput", "--policy", "sjf", "--policy-options", '{"aging": 2}'])
    assert (args.policy, args.policy_options) == ("sjf", {"aging": 2})
    assert parser.parse_args(["throughput"]).policy == "fcfs"
    assert main(["bench", "throughput", "--dtype", "float32", "--policy", "no-such-policy"]) == 2
    assert "invalid config field 'policy'='no-such-policy'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["throughput", "--policy-options", "[1]"])
