"""Finding policies: the entry-point group `pagedserve.policies` only (built-ins included)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from pagedserve.services.scheduler.policy import PolicyError, SchedulingPolicy
from pagedserve.shared.config import ConfigError

GROUP = "pagedserve.policies"


@dataclass(frozen=True)
class InstalledPolicy:
    name: str
    target: str  # "module:Class"
    distribution: str | None  # the package that registered it


def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)  # the first on sys.path wins
    return found


def installed_policies() -> list[InstalledPolicy]:
    return [InstalledPolicy(name, ep.value, ep.dist.name if ep.dist is not None else None)
            for name, ep in sorted(_entry_points().items())]


def load_policy(name: str, options: dict | None = None) -> SchedulingPolicy:
    eps = _entry_points()
    if name not in eps:
        raise PolicyError(f"no policy {name!r} installed (installed: {sorted(eps)})")
    try:
        cls = eps[name].load()
    except Exception as e:  # a broken plugin is a config error naming it, not a crash
        raise PolicyError(f"policy {name!r} ({eps[name].value}) cannot be loaded: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
        raise PolicyError(f"policy {name!r} ({eps[name].value}) is not a SchedulingPolicy")
    options = dict(options or {})
    try:
        return cls(**options)
    except PolicyError:
        raise
    except Exception as e:  # a plugin's own error: the command fails, never the scheduler
        raise PolicyError(f"policy {name!r} refused options {options}: {e}") from e


def configured_policy(name: str, options: dict | None = None) -> SchedulingPolicy:
    """load_policy from config, raising ConfigError naming 'policy' or 'policy_options'."""
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"invalid config field 'policy_options'={options!r}: must be a JSON object")
    try:
        return load_policy(name, options)
    except PolicyError as e:
        raise ConfigError(f"invalid config field 'policy'={name!r}: {e}") from None
