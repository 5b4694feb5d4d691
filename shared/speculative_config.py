"""`--speculative-config`, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": a, "prompt_lookup_max": b}. Off (None) unless given; one validation here.

As vLLM: with neither bound given both are 5; with one given the other equals it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedserve.shared.config_error import ConfigError

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32  # drafts per request per step: more only burn budget on a CPU
DEFAULT_PROMPT_LOOKUP = 5
# the stats blob's key of accepted drafts at position p: f"{PER_POS_KEY}{p}_total"
PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos_"
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in _FIELDS})


def _bad(why: str, value) -> ConfigError:
    return ConfigError(f"invalid config field 'speculative_config'={value!r}: {why}")


def _whole(value, name: str, low: int, high: int, whole) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"{name} must be an integer in [{low}, {high}]", whole)
    return value


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """A JSON object (text or dict), or None/"" for off -> SpeculativeConfig; ConfigError naming it."""
    if value is None or value == "" or value == {}:
        return None
    whole = value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(f"not JSON ({e})", whole) from None
    if not isinstance(value, dict):
        raise _bad("must be a JSON object", whole)
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        raise _bad(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}", whole)
    method = value.get("method")
    if method not in METHODS:
        raise _bad(f"method must be one of {', '.join(METHODS)} (got {method!r})", whole)
    if "num_speculative_tokens" not in value:
        raise _bad("num_speculative_tokens is required", whole)
    k = _whole(value["num_speculative_tokens"], "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS, whole)
    low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    low = _whole(low, "prompt_lookup_min", 1, 1024, whole)
    high = _whole(high, "prompt_lookup_max", 1, 1024, whole)
    if low > high:
        raise _bad("prompt_lookup_min must be <= prompt_lookup_max", whole)
    return SpeculativeConfig(method, k, low, high)
