"""`pagedserve policies`: list the installed scheduling policies (no model, no torch)."""

from __future__ import annotations

import argparse
import json

from pagedserve.services.scheduler.policies.registry import installed_policies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per policy")


def run(args: argparse.Namespace) -> int:
    for policy in installed_policies():
        if args.json:
            print(json.dumps({"name": policy.name, "target": policy.target, "distribution": policy.distribution}))
        else:
            print(f"{policy.name:12} {policy.target}  ({policy.distribution or '?'})")
    return 0
