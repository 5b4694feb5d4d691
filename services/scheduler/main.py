"""`pagedserve scheduler`: the scheduler service (see loop.py for what it does over Redis).

Its model limits (max_model_len, eos ids) come from the worker's hello, not from options.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedserve.shared import redis_io
from pagedserve.shared.config import ConfigError
from pagedserve.shared.speculative_config import parse_speculative_config
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.scheduler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    redis_io.add_common_arguments(parser)
    parser.add_argument("--policy", default="fcfs",
                        help="scheduling policy: an entry point of group pagedserve.policies (`pagedserve policies`)")
    parser.add_argument("--policy-options", default="{}", help='the policy\'s options as JSON, e.g. \'{"aging": 2}\'')
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="admission: past this many waiting requests the api answers 429 (default unbounded)")
    parser.add_argument("--max-waiting-tokens", type=int, default=None,
                        help="admission: past this many waiting tokens (prompt + max_tokens) the api answers 429")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=256,
                        help="most tokens one prompt prefills per step, fewer past 2048 tokens of context, "
                             "so a long prompt leaves room for others (0: no cap; default 256)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="plan the next step while the worker runs the current one (default on)")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": '
                             '4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (default off; it plans each step '
                             "after the last one's result, so async scheduling is off with it)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="send a request's tokens to the api every N tokens (its first and last at once); "
                             "more than 1 trades streaming smoothness for less CPU per token (default 1)")
    parser.add_argument("--router", default="prefix", choices=["prefix", "round-robin"],
                        help="placement of each request on a worker: prefix (lowest prefill_weight x uncached "
                             "prompt blocks + decode_weight x the worker's load in blocks; default) or round-robin")
    parser.add_argument("--prefill-weight", type=float, default=1.0,
                        help="router cost of one prompt block not cached on a worker (default 1)")
    parser.add_argument("--decode-weight", type=float, default=1.0,
                        help="router cost of one block of the requests already on a worker (default 1)")
    parser.add_argument("--step-timeout", type=float, default=30.0,
                        help="seconds to wait for the kvstore's or the worker's reply before resetting them")


def load_policy(name: str, options_json: str = "{}"):
    """The installed policy `name` with its options; ConfigError naming the field."""
    from pagedserve.services.scheduler.policies.registry import configured_policy

    try:
        options = json.loads(options_json)
    except ValueError as e:
        raise ConfigError(f"invalid config field 'policy_options'={options_json!r}: not JSON ({e})") from None
    if not isinstance(options, dict):
        raise ConfigError(f"invalid config field 'policy_options'={options_json!r}: must be a JSON object")
    return configured_policy(name, options)


def _check(args: argparse.Namespace) -> None:
    for field in ("max_num_seqs", "max_num_batched_tokens", "stream_interval"):
        if getattr(args, field) < 1:
            raise ConfigError(f"invalid config field {field!r}={getattr(args, field)!r}: at least 1")
    for field in ("max_waiting_requests", "max_waiting_tokens"):
        if getattr(args, field) is not None and getattr(args, field) < 1:
            raise ConfigError(f"invalid config field {field!r}={getattr(args, field)!r}: at least 1")
    if args.long_prefill_token_threshold < 0:
        raise ConfigError(f"invalid config field 'long_prefill_token_threshold'="
                          f"{args.long_prefill_token_threshold!r}: 0 (no cap) or more")
    if not args.step_timeout > 0:
        raise ConfigError(f"invalid config field 'step_timeout'={args.step_timeout!r}: must be > 0")
    check_router(args.router, args.prefill_weight, args.decode_weight)


def check_router(router: str, prefill_weight: float, decode_weight: float) -> None:
    from pagedserve.services.scheduler.placement import ROUTERS

    if router not in ROUTERS:
        raise ConfigError(f"invalid config field 'router'={router!r}: one of {', '.join(ROUTERS)}")
    for field, value in (("prefill_weight", prefill_weight), ("decode_weight", decode_weight)):
        if not value >= 0 or value == float("inf"):
            raise ConfigError(f"invalid config field {field!r}={value!r}: a finite number >= 0")
    if prefill_weight == decode_weight == 0:
        raise ConfigError("invalid config field 'decode_weight'=0.0: prefill_weight and decode_weight both 0")


def run(args: argparse.Namespace) -> int:
    from pagedserve.services.scheduler.loop import SchedulerLoop
    from pagedserve.services.scheduler.placement import Router
    from pagedserve.services.scheduler.scheduler import Scheduler

    try:
        redis_io.setup_logging(args.log_level)
        _check(args)
        policy = load_policy(args.policy, args.policy_options)
        speculative = parse_speculative_config(args.speculative_config)
    except ConfigError as e:
        log.critical("bad config: %s", e)
        return 2
    async_scheduling = args.async_scheduling and speculative is None  # drafts need the last step's tokens
    log.info("scheduler starting: redis=%s prefix=%s policy=%s async_scheduling=%s router=%s speculative=%s",
             args.redis_url, args.prefix, policy.name, async_scheduling, args.router,
             speculative.to_json() if speculative else "off")

    def make_scheduler() -> Scheduler:  # one per worker; the policy object is shared (loop.py)
        return Scheduler(policy, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
                         max_steps_in_flight=2 if async_scheduling else 1, stream_interval=args.stream_interval,
                         long_prefill_token_threshold=args.long_prefill_token_threshold,
                         speculative_config=speculative)

    router = Router(args.router, args.prefill_weight, args.decode_weight)
    return redis_io.run_loop(args.redis_url, "scheduler", lambda r: SchedulerLoop(
        r, Keys(args.prefix), make_scheduler, args.step_timeout, router))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pagedserve scheduler")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
