"""`pagedserve kvstore`: the block-accounting service; pool sizes come from the workers' hellos."""

from __future__ import annotations

import argparse
import logging
import sys

from pagedserve.shared import redis_io
from pagedserve.shared.config import DEFAULT_KV_OFFLOAD_MEMORY, ConfigError, kv_offload_bytes
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.kvstore")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    redis_io.add_common_arguments(parser)
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                        help="share full blocks between requests with the same prefix (default: on)")
    parser.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", help="no prefix sharing (to compare)")
    parser.add_argument("--watermark", type=float, default=0.01,
                        help="fraction of the pool admission keeps free for running requests to grow into")
    parser.add_argument("--kv-offload-memory", default=DEFAULT_KV_OFFLOAD_MEMORY,
                        help="the offload tier's budget of KV block contents in Redis, shared by every worker "
                             f"(0: off; default {DEFAULT_KV_OFFLOAD_MEMORY})")


def run(args: argparse.Namespace) -> int:
    from pagedserve.services.kvstore.loop import KvStoreLoop

    try:
        redis_io.setup_logging(args.log_level)
        if not 0.0 <= args.watermark < 1.0:
            raise ConfigError(f"invalid config field 'watermark'={args.watermark!r}: must be in [0, 1)")
        tier_bytes = kv_offload_bytes(args.kv_offload_memory)
    except ConfigError as e:
        log.critical("bad config: %s", e)
        return 2
    log.info("kvstore starting: redis=%s prefix=%s", args.redis_url, args.prefix)
    redis_io.settle_gc()

    return redis_io.run_loop(args.redis_url, "kvstore", lambda r: KvStoreLoop(
        r, Keys(args.prefix), enable_prefix_caching=args.enable_prefix_caching, watermark=args.watermark,
        tier_capacity_bytes=tier_bytes))



if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="pagedserve kvstore")
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
