"""--speculative-config parsing, as vLLM takes it: defaults, and a ConfigError naming the field."""

from __future__ import annotations

import pytest

from pagedserve.shared.config import ConfigError, EngineConfig
from pagedserve.shared.speculative_config import DEFAULT_STEP_COSTS, SpeculativeConfig, parse_speculative_config


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
    ({"method": "suffix", "prompt_lookup_min": 2}, "prompt_lookup_min not taken by method suffix"),
    ({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
     "suffix_decoding_max_tree_depth not taken by method ngram"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be a number"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an integer"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be"),
    ({"method": "suffix", "adaptive_draft_length": 1}, "adaptive_draft_length must be true or false"),
    ({"method": "suffix", "adaptive_draft_length": False, "step_costs": [[1, 1.0]]}, "step_costs needs adaptive"),
    ({"method": "suffix", "step_costs": []}, "step_costs must be a non-empty list"),
    ({"method": "suffix", "learn_step_costs": 1}, "learn_step_costs must be true or false"),
    ({"method": "suffix", "adaptive_draft_length": False, "learn_step_costs": True}, "needs adaptive_draft_length"),
    ({"method": "suffix", "step_costs": [[1, 1.0, 2]]}, "step_costs must be a non-empty list"),
    ({"method": "suffix", "step_costs": [[0, 1.0]]}, "step_costs tokens must be an integer"),
    ({"method": "suffix", "step_costs": [[1, 0]]}, "step_costs cost must be a number"),
    ({"method": "suffix", "step_costs": [[2, 1.0], [2, 1.5]]}, "step_costs tokens must increase"),
])
def test_bad_values_name_the_field(value, says):
    with pytest.raises(ConfigError, match="speculative_config") as info:
        parse_speculative_config(value)
    assert says in str(info.value)
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineConfig(speculative_config=value)


def test_suffix_takes_vllms_fields_and_defaults():
    assert parse_speculative_config({"method": "suffix"}) == SpeculativeConfig("suffix", 24, 5, 5, 24, 1.0, 0.1, 1000)
    given = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 16,
             "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0.25,
             "suffix_decoding_max_cached_requests": 0}
    expected = SpeculativeConfig("suffix", 8, 5, 5, 16, 2.0, 0.25, 0)
    assert parse_speculative_config(given) == expected
    assert parse_speculative_config(expected.to_json()) == expected
    assert parse_speculative_config({"method": "suffix", "suffix_decoding_max_tree_depth": 64}).num_speculative_tokens == 32



def test_draft_length_adapts_to_the_default_costs_unless_told():
    base = {"method": "ngram", "num_speculative_tokens": 3}
    learned = parse_speculative_config(base)
    assert learned.step_costs == DEFAULT_STEP_COSTS and learned.learn_step_costs
    fixed = parse_speculative_config({**base, "adaptive_draft_length": False})
    assert fixed == SpeculativeConfig("ngram", 3, 5, 5, step_costs=None, learn_step_costs=False)
    given = parse_speculative_config({"method": "suffix", "step_costs": [[1, 1], [8, 1.5], [9, 3.0]]})
    assert given.step_costs == ((1, 1.0), (8, 1.5), (9, 3.0)) and not given.learn_step_costs
    prior = parse_speculative_config({**base, "step_costs": [[1, 1], [9, 3.0]], "learn_step_costs": True})
    assert prior.learn_step_costs and not parse_speculative_config({**base, "learn_step_costs": False}).learn_step_costs
    for config in (learned, fixed, given, prior):
        assert parse_speculative_config(config.to_json()) == config
