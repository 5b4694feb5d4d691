"""The `pagedserve` command: subcommand modules (add_arguments, run) import lazily, so --help never loads torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pagedserve.services.launcher.up", "run the whole stack on this machine (embedded Redis if no REDIS_URL)"),
    "api": ("pagedserve.services.api.main", "the HTTP api: OpenAI-compatible routes, WebSocket streaming"),
    "scheduler": ("pagedserve.services.scheduler.main", "the scheduler: request states, the step loop, the policy"),
    "kvstore": ("pagedserve.services.kvstore.main", "the kvstore: block accounting, prefix cache"),
    "worker": ("pagedserve.services.gpu_worker.main", "a model worker: weights, KV pool, forward passes"),
    "policies": ("pagedserve.services.scheduler.policies.command", "list the installed scheduling policies (plugins)"),
    "generate": ("pagedserve.services.launcher.generate", "answer one prompt from the terminal (in-process engine)"),
    "bench": ("pagedserve.services.bench.command", "benchmarks: pagedserve bench throughput --workload random-64 --baseline hf"),
    "healthcheck": ("pagedserve.services.launcher.healthcheck", "exit 0 if a service is alive (for container healthchecks)"),
    "build-kernels": ("pagedserve.services.gpu_worker.kernels.build", "compile the CPU kernels now, ahead of the first start"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: an LLM serving system "
                                     "(paged KV cache, continuous batching) as services over Redis.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The full parser of one command, and its module."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"pagedserve {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = top_parser()
        args = parser.parse_args(argv)  # --help, or an error naming the unknown command
        if args.version:
            print(f"pagedserve {_version()}")
            return 0
        parser.print_help()
        return 2
    parser, module = command_parser(argv[0])
    args = parser.parse_args(argv[1:])
    try:
        code = module.run(args)
    except KeyboardInterrupt:
        return 130
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
