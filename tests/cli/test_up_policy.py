"""`pagedserve up` hands the policy, admission bounds, stream interval and per-request limits to the right
services, and refuses a policy that is not installed before starting anything."""

import argparse

import pytest

from pagedserve.services.launcher import up
from pagedserve.shared.config import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_policy_and_admission_options_reach_the_scheduler_and_limits_the_api():
    args = _args("--policy", "sjf", "--policy-options", '{"aging": 3}', "--max-num-seqs", "8", "--stream-interval", "4",
                 "--max-waiting-requests", "100", "--max-prompt-tokens", "512", "--max-output-tokens", "64")
    up.check_args(args)
    commands = dict(up.service_commands(args, "redis://127.0.0.1:6379/0"))
    scheduler, api = " ".join(commands["scheduler"]), " ".join(commands["api"])
    assert "--policy sjf --policy-options {\"aging\": 3}" in scheduler
    assert "--max-num-seqs 8" in scheduler and "--max-waiting-requests 100" in scheduler
    assert "--stream-interval 4" in scheduler and "--stream-interval" not in api
    assert "--max-waiting-tokens" not in scheduler
    assert "--max-prompt-tokens 512" in api and "--max-output-tokens 64" in api


def test_the_token_budget_and_the_long_prefill_threshold_reach_the_scheduler():
    args = _args("--max-num-batched-tokens", "1024", "--long-prefill-token-threshold", "0")
    up.check_args(args)
    scheduler = " ".join(dict(up.service_commands(args, "redis://127.0.0.1:6379/0"))["scheduler"])
    assert "--max-num-batched-tokens 1024" in scheduler and "--long-prefill-token-threshold 0" in scheduler


@pytest.mark.parametrize(("argv", "named"), [
    (["--policy", "nope"], "'policy'"),
    (["--policy", "sjf", "--policy-options", '{"speed": 1}'], "'speed'"),
    (["--policy-options", "[1]"], "'policy_options'"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests"),
    (["--stream-interval", "0"], "--stream-interval"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold"),
    (["--restart-delay", "0"], "--restart-delay"),
    (["--restart-delay", "31"], "--restart-delay"),
])
def test_bad_policy_config_fails_before_start_naming_the_field(argv, named):
    with pytest.raises(ConfigError, match=named):
        up.check_args(_args(*argv))
