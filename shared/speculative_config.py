"""`--speculative-config`, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": a, "prompt_lookup_max": b}, or {"method": "suffix", ...} with vLLM's
suffix_decoding_* fields. Off (None) unless given; one validation here.

Ours: "step_costs": [[tokens, relative step time], ...] for draft_cost.py, learned from step times
unless given ("learn_step_costs"); "adaptive_draft_length": false drafts num_speculative_tokens always.

As vLLM: with neither bound given both are 5; with one given the other equals it; suffix drafts at
most max_tree_depth tokens unless num_speculative_tokens says fewer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from pagedserve.shared.config_error import ConfigError

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 32  # drafts per request per step: more only burn budget on a CPU
DEFAULT_PROMPT_LOOKUP = 5
# the stats blob's key of accepted drafts at position p: f"{PER_POS_KEY}{p}_total"
PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos_"
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1, "suffix_decoding_max_cached_requests": 1000}
# float32 SmolLM2-135M on a Zen 3/4 CPU: up to 8 rows the few-row gemv kernel, from 9 oneDNN's GEMM
DEFAULT_STEP_COSTS: tuple[tuple[int, float], ...] = (
    (1, 1.0), (2, 1.34), (5, 1.84), (8, 2.38), (9, 5.31), (16, 6.86), (32, 10.1), (64, 18.0), (128, 33.3))
_COST_FIELDS = ("step_costs", "adaptive_draft_length", "learn_step_costs")
_NGRAM_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", *_COST_FIELDS)
_SUFFIX_FIELDS = ("method", "num_speculative_tokens", *SUFFIX_DEFAULTS, *_COST_FIELDS)
_FIELDS = (*_NGRAM_FIELDS, *SUFFIX_DEFAULTS)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    suffix_decoding_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
    suffix_decoding_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_decoding_max_spec_factor"]
    suffix_decoding_min_token_prob: float = SUFFIX_DEFAULTS["suffix_decoding_min_token_prob"]
    suffix_decoding_max_cached_requests: int = SUFFIX_DEFAULTS["suffix_decoding_max_cached_requests"]
    step_costs: tuple[tuple[int, float], ...] | None = DEFAULT_STEP_COSTS  # None: fixed draft length
    learn_step_costs: bool = True

    def to_json(self) -> str:
        names = _SUFFIX_FIELDS if self.method == "suffix" else _NGRAM_FIELDS
        got = {name: getattr(self, name) for name in names if name not in _COST_FIELDS}
        got["adaptive_draft_length"] = self.step_costs is not None
        if self.step_costs is not None:
            got["step_costs"] = [list(point) for point in self.step_costs]
            got["learn_step_costs"] = self.learn_step_costs
        return json.dumps(got)


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
    costs = _step_costs(value, whole)
    learn = value.get("learn_step_costs", "step_costs" not in value and costs is not None)
    if not isinstance(learn, bool) or (learn and costs is None):
        raise _bad("learn_step_costs must be true or false, and needs adaptive_draft_length", whole)
    if method == "suffix":
        return replace(_suffix(value, whole), step_costs=costs, learn_step_costs=learn)
    _only(value, _NGRAM_FIELDS, "ngram", whole)
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
    return SpeculativeConfig(method, k, low, high, step_costs=costs, learn_step_costs=learn)


def _step_costs(value: dict, whole) -> tuple[tuple[int, float], ...] | None:
    adaptive = value.get("adaptive_draft_length", True)
    if not isinstance(adaptive, bool):
        raise _bad("adaptive_draft_length must be true or false", whole)
    if "step_costs" not in value:
        return DEFAULT_STEP_COSTS if adaptive else None
    if not adaptive:
        raise _bad("step_costs needs adaptive_draft_length", whole)
    costs, points = value["step_costs"], []
    if not isinstance(costs, list) or not costs:
        raise _bad("step_costs must be a non-empty list of [tokens, cost]", whole)
    for point in costs:
        if not isinstance(point, list) or len(point) != 2:
            raise _bad("step_costs must be a non-empty list of [tokens, cost]", whole)
        points.append((_whole(point[0], "step_costs tokens", 1, 1 << 20, whole),
                       _fraction(point[1], "step_costs cost", 1e-6, 1e6, whole)))
    if any(a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)):
        raise _bad("step_costs tokens must increase", whole)
    return tuple(points)


def _fraction(value, name: str, low: float, high: float, whole) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"{name} must be a number in [{low}, {high}]", whole)
    return float(value)


def _only(value: dict, names: tuple[str, ...], method: str, whole) -> None:
    other = sorted(set(value) - set(names))
    if other:
        raise _bad(f"{', '.join(other)} not taken by method {method}", whole)


def _suffix(value: dict, whole) -> SpeculativeConfig:
    _only(value, _SUFFIX_FIELDS, "suffix", whole)
    got = SUFFIX_DEFAULTS | value
    depth = _whole(got["suffix_decoding_max_tree_depth"], "suffix_decoding_max_tree_depth", 1, 1024, whole)
    k = _whole(value.get("num_speculative_tokens", min(depth, MAX_SPECULATIVE_TOKENS)), "num_speculative_tokens",
               1, MAX_SPECULATIVE_TOKENS, whole)
    factor = _fraction(got["suffix_decoding_max_spec_factor"], "suffix_decoding_max_spec_factor", 0.0, 1024.0, whole)
    prob = _fraction(got["suffix_decoding_min_token_prob"], "suffix_decoding_min_token_prob", 0.0, 1.0, whole)
    cached = _whole(got["suffix_decoding_max_cached_requests"], "suffix_decoding_max_cached_requests", 0, 10**6, whole)
    return SpeculativeConfig("suffix", k, DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP, depth, factor, prob, cached)
