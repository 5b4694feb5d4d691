"""--speculative-config parsing, as vLLM takes it: defaults, and a ConfigError naming the field."""

from __future__ import annotations

import pytest

from pagedserve.shared.config import ConfigError, EngineConfig
from pagedserve.shared.speculative_config import SpeculativeConfig, parse_speculative_config


@pytest.mark.parametrize("off", [None, "", {}])
def test_off_unless_given(off):
    assert parse_speculative_config(off) is None
    assert EngineConfig().speculative_config is None


def test_json_text_and_dict_give_the_same_config():
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}'
    expected = SpeculativeConfig("ngram", 4, 2, 3)
    assert parse_speculative_config(text) == expected
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 3}) == expected
    assert parse_speculative_config(expected.to_json()) == expected


def test_lookup_bounds_default_as_vllm():
    base = {"method": "ngram", "num_speculative_tokens": 3}
    assert parse_speculative_config(base) == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse_speculative_config({**base, "prompt_lookup_max": 4}) == SpeculativeConfig("ngram", 3, 4, 4)
    assert parse_speculative_config({**base, "prompt_lookup_min": 2}) == SpeculativeConfig("ngram", 3, 2, 2)


@pytest.mark.parametrize(("value", "says"), [
    ("{not json", "not JSON"),
    ("[1]", "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 32]"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min must be <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) draft_model"),
])
def test_bad_values_name_the_field(value, says):
    with pytest.raises(ConfigError, match="speculative_config") as info:
        parse_speculative_config(value)
    assert says in str(info.value)
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineConfig(speculative_config=value)
