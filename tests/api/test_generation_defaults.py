"""generation_config.json's sampling values default the fields a request omits, as vLLM's
`--generation-config auto`: values equal to transformers' defaults and GGUFs change nothing."""

from __future__ import annotations

import json

from pagedserve.services.api.inputs import ModelInfo, prepare
from pagedserve.services.api.protocol import parse_body
from pagedserve.shared.generation_defaults import generation_defaults
from pagedserve.shared.model_source import resolve_model

QWEN25_INSTRUCT = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                   "pad_token_id": 151643, "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8,
                   "top_k": 20, "transformers_version": "4.37.0"}


def test_a_folders_generation_config_gives_its_sampling_values(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25_INSTRUCT))
    assert generation_defaults(str(tmp_path)) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                  "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 1.0, "min_p": 0.1}))
    assert generation_defaults(str(tmp_path)) == {"min_p": 0.1}  # transformers' defaults are no change
    (tmp_path / "generation_config.json").unlink()
    assert generation_defaults(str(tmp_path)) == {}
    assert generation_defaults(resolve_model("smollm2")) == {}  # a GGUF file


def test_omitted_fields_take_the_defaults_given_ones_win(tokenizer):
    info = ModelInfo(served_name="m", max_model_len=2048, vocab_size=tokenizer.vocab_size,
                     sampling_defaults={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    omitted = prepare(parse_body(json.dumps(body).encode()), tokenizer, info).sampling
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.repetition_penalty, omitted.min_p) == \
        (0.7, 0.8, 20, 1.05, 0.0)
    given = {**body, "temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
    sampling = prepare(parse_body(json.dumps(given).encode()), tokenizer, info).sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty) == (0.0, 1.0, 0, 1.0)


def test_max_new_tokens_defaults_an_omitted_max_tokens(tmp_path, tokenizer):
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN25_INSTRUCT, "max_new_tokens": 7}))
    defaults = generation_defaults(str(tmp_path))
    assert defaults["max_tokens"] == 7
    info = ModelInfo(served_name="m", max_model_len=2048, vocab_size=tokenizer.vocab_size, sampling_defaults=defaults)

    def max_tokens(**fields) -> int:
        return prepare(parse_body(json.dumps(fields).encode()), tokenizer, info).sampling.max_tokens

    chat = [{"role": "user", "content": "hi"}]
    assert max_tokens(messages=chat) == 7
    assert max_tokens(messages=chat, max_tokens=30) == 30  # a request's own value wins
    assert max_tokens(prompt="hi") == 7  # below the completions' default of 16
    assert max_tokens(prompt="hi", max_tokens=30) == 30
