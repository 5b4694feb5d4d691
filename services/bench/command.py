"""`pagedserve bench throughput ...`: dispatch to the benchmark kinds (serve comes later)."""

from __future__ import annotations

import argparse

from services.bench import throughput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["throughput"], help="throughput: the in-process engine, offline")
    throughput.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return throughput.run(args)
