"""The scheduler's settings, each defined once: `pagedserve scheduler` takes them as options,
`pagedserve up` passes on those it is given, the in-process engine (EngineConfig) and the
Scheduler core take their defaults from here, and this is their one validation."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from pagedserve.shared.config_error import ConfigError
from pagedserve.shared.options import check_fields, option

ROUTERS = ("prefix", "round-robin")
DEFAULT_POLICY = "fcfs"  # an installed `pagedserve.policies` entry point


def policy_options(text: str | dict) -> dict:
    """The policy's options from a JSON object's text; ConfigError naming policy_options."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"invalid config field 'policy_options'={text!r}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"invalid config field 'policy_options'={text!r}: must be a JSON object")
    return value


def _options_argument(text: str) -> dict:
    try:
        return policy_options(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_policy_arguments(parser: argparse.ArgumentParser, parse_options: bool = False) -> None:
    """--policy, --policy-options and --speculative-config, each with its one default; parse_options:
    --policy-options becomes a dict while parsing (else JSON text, checked by policy_options)."""
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"scheduling policy: an installed one (`pagedserve policies`; default {DEFAULT_POLICY})")
    parser.add_argument("--policy-options", default="{}", type=_options_argument if parse_options else str,
                        metavar="JSON", help='the policy\'s options as a JSON object, e.g. \'{"aging": 2}\'')
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": '
                             '4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (default off)')


@dataclass
class StepLimits:
    """What one step may hold: the engine's settings and the scheduler service's."""

    max_num_seqs: int = option(256, "most requests running at once", minimum=1)
    max_num_batched_tokens: int = option(2048, "token budget of one step, prefill chunks and decodes together",
                                         minimum=1)
    long_prefill_token_threshold: int = option(
        256, "most tokens one prompt prefills per step, fewer past 2048 tokens of context, so a long prompt "
             "leaves room for others (0: no cap)", minimum=0)
    num_scheduler_steps: int = option(
        8, "decode steps the worker runs per plan while every scheduled request decodes (vLLM's multi-step "
           "scheduling): the scheduler, kvstore and api wake once per N tokens; a new request waits up to N "
           "steps for its prefill (1: a plan per token)", minimum=1)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class SchedulerConfig(StepLimits):
    """The scheduler service's settings beside the step limits."""

    stream_interval: int = option(1, "send a request's tokens to the api every N tokens (its first and last at "
                                     "once); more than 1 trades streaming smoothness for less CPU per token", minimum=1)
    max_waiting_requests: int | None = option(None, "admission: past this many waiting requests the api answers 429",
                                              minimum=1, kind=int)
    max_waiting_tokens: int | None = option(None, "admission: past this many waiting tokens (prompt + max_tokens) "
                                                  "the api answers 429", minimum=1, kind=int)
    async_scheduling: bool = option(True, "plan the next step while the worker runs the current one")
    router: str = option("prefix", "placement of each request on a worker: prefix (lowest prefill_weight x uncached "
                                   "prompt blocks + decode_weight x the worker's load in blocks) or round-robin",
                         choices=ROUTERS)
    prefill_weight: float = option(1.0, "router cost of one prompt block not cached on a worker", minimum=0)
    decode_weight: float = option(1.0, "router cost of one block of the requests already on a worker", minimum=0)
    step_timeout: float = option(30.0, "seconds to wait for the kvstore's or the worker's reply before resetting "
                                       "them", above=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_weight == self.decode_weight == 0:
            raise ConfigError("invalid config field 'decode_weight' (--decode-weight)=0.0: prefill_weight and "
                              "decode_weight both 0")
