"""`pagedserve scheduler`: the scheduler service (see loop.py for what it does over Redis).

Its model limits (max_model_len, eos ids) come from the worker's hello, not from options.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.shared import redis_io
from pagedserve.shared.config import ConfigError
from pagedserve.shared.options import add_options, from_args
from pagedserve.shared.scheduler_config import SchedulerConfig, add_policy_arguments, policy_options
from pagedserve.shared.speculative_config import parse_speculative_config
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.scheduler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    redis_io.add_common_arguments(parser)
    add_policy_arguments(parser)
    add_options(parser, SchedulerConfig)


def load_policy(name: str, options_json: str = "{}"):
    """The installed policy `name` with its options; ConfigError naming the field."""
    from pagedserve.services.scheduler.policies.registry import configured_policy

    return configured_policy(name, policy_options(options_json))


def run(args: argparse.Namespace) -> int:
    from pagedserve.services.scheduler.loop import SchedulerLoop
    from pagedserve.services.scheduler.placement import Router
    from pagedserve.services.scheduler.scheduler import Scheduler

    try:
        redis_io.setup_logging(args.log_level)
        config = from_args(SchedulerConfig, args)
        policy = load_policy(args.policy, args.policy_options)
        speculative = parse_speculative_config(args.speculative_config)
    except ConfigError as e:
        log.critical("bad config: %s", e)
        return 2
    log.info("scheduler starting: redis=%s prefix=%s policy=%s async_scheduling=%s router=%s speculative=%s",
             args.redis_url, args.prefix, policy.name, config.async_scheduling, config.router,
             speculative.to_json() if speculative else "off")

    def make_scheduler() -> Scheduler:  # one per worker; the policy object is shared (loop.py)
        return Scheduler(policy, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                         max_waiting_requests=config.max_waiting_requests, max_waiting_tokens=config.max_waiting_tokens,
                         max_steps_in_flight=2 if config.async_scheduling else 1, stream_interval=config.stream_interval,
                         long_prefill_token_threshold=config.long_prefill_token_threshold,
                         speculative_config=speculative, num_scheduler_steps=config.num_scheduler_steps)

    router = Router(config.router, config.prefill_weight, config.decode_weight)
    redis_io.settle_gc()
    return redis_io.run_loop(args.redis_url, "scheduler", lambda r: SchedulerLoop(
        r, Keys(args.prefix), make_scheduler, config.step_timeout, router))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pagedserve scheduler")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
