"""Settings defined once, as dataclass fields: each with its default, its help and its bounds in
the field's metadata. A service's command line is made from the fields (add_options), read back
into the dataclass (from_args), whose check_fields is the one validation, and passed on by a
launcher (command_line)."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, field, fields

from pagedserve.shared.config_error import ConfigError


def option(default, help: str, *, minimum: float | None = None, above: float | None = None,
           choices: tuple[str, ...] | None = None, kind: type | None = None):
    """A dataclass field that is also a command-line option --<name-with-dashes>; kind: its type
    where the default (None) does not tell."""
    return field(default=default, metadata={"help": help, "minimum": minimum, "above": above, "choices": choices,
                                            "kind": kind or type(default)})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_fields(config) -> None:
    """ConfigError naming the first field outside its bounds (None passes where it is the default)."""
    for f in fields(config):
        meta, value = f.metadata, getattr(config, f.name)
        if "help" not in meta or (value is None and f.default is None):
            continue
        why = None
        if meta["choices"] is not None and value not in meta["choices"]:
            why = f"one of {', '.join(meta['choices'])}"
        elif meta["kind"] in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                              or not math.isfinite(value)):
            why = "a finite number"
        elif meta["minimum"] is not None and value < meta["minimum"]:
            why = f"at least {meta['minimum']}"
        elif meta["above"] is not None and not value > meta["above"]:
            why = f"must be > {meta['above']}"
        if why is not None:
            raise ConfigError(f"invalid config field {f.name!r} ({flag(f.name)})={value!r}: {why}")


def add_options(parser: argparse.ArgumentParser, cls, defaults: bool = True) -> None:
    """One option per field of cls; defaults False: an option not given is None (a launcher passes
    on only what it was given, and the service's own default applies)."""
    for f in fields(cls):
        meta = f.metadata
        default = f.default if f.default is not MISSING else None
        text = f"{meta['help']} (default {'none' if default is None else default})"
        if meta["kind"] is bool:
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction,
                                default=default if defaults else None, help=text)
        else:
            parser.add_argument(flag(f.name), type=meta["kind"], default=default if defaults else None,
                                choices=meta["choices"], help=text)


def from_args(cls, args: argparse.Namespace):
    """The dataclass of the options given (None: its default); validated on construction."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})


def command_line(config, names) -> list[str]:
    """The options that give config's values of the fields named, for a service's argv."""
    argv = []
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif value is not None:
            argv += [flag(name), str(value)]
    return argv
