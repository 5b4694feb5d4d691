"""Body parsing and validation (pure: real tokenizer, no server): each bad input -> its 4xx,
good inputs -> the SamplingParams the scheduler gets."""

from __future__ import annotations

import json

import pytest

from pagedserve.services.api.inputs import ModelInfo, prepare
from pagedserve.services.api.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body
from pagedserve.shared.model_source import SMOLLM2_NAMES

INFO = ModelInfo(served_name="smollm2", max_model_len=8192, vocab_size=49152,
                 aliases={n.lower() for n in SMOLLM2_NAMES})
CHAT = [{"role": "user", "content": "hi"}]


def _prepare(tokenizer, body: dict | bytes, cls=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return prepare(parse_body(raw, cls), tokenizer, INFO)


def _error(tokenizer, body, cls=None) -> ApiError:
    with pytest.raises(ApiError) as info:
        _prepare(tokenizer, body, cls)
    return info.value


BAD_BODIES = [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "invalid_type"),
    ({"prompt": "hi", "max_tokens": 5.0}, 400, "invalid_type"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "invalid_type"),
    ({"prompt": "hi", "ignore_eos": 1}, 400, "invalid_type"),
    ({"prompt": "hi", "speculative_decoding": "no"}, 400, "invalid_type"),
    ({"prompt": "hi", "speculative_decoding": 0}, 400, "invalid_type"),
    ({"prompt": "hi", "speculative_decoding": None}, 400, "invalid_type"),
    ({"prompt": 12}, 400, "invalid_type"),
    ({"max_tokens": 5}, 400, "missing_field"),
    ({"prompt": ""}, 400, "empty_prompt"),
    ({"prompt": []}, 400, "empty_prompt"),
    ({"prompt": [1, 2, 999999]}, 400, None),
    ({"prompt": [-1]}, 400, None),
    ({"prompt": ["a", [999999]]}, 400, None),  # a list: one prompt per request here, a bad id on /v1/completions
    ({"prompt": "hi", "max_tokens": 0}, 400, None),
    ({"prompt": "hi", "max_tokens": -3}, 400, None),
    ({"prompt": "hi", "max_tokens": 8192}, 400, "context_length_exceeded"),
    ({"prompt": [5] * 8000, "max_tokens": 200}, 400, "context_length_exceeded"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found"),
    ({"prompt": "hi", "n": 17}, 400, None),  # above MAX_N
    ({"prompt": "hi", "n": 2, "seed": 2**63 - 1}, 400, None),  # choice 1 would need seed + 1
    ({"prompt": "hi", "n": 0}, 400, "invalid_value"),
    ({"prompt": "hi", "best_of": 3}, 400, "unsupported"),
    ({"prompt": "hi", "prompt_logprobs": 21}, 400, None),
    ({"prompt": "hi", "temperature": -0.5}, 400, None),
    ({"prompt": "hi", "top_p": 0}, 400, None),
    ({"prompt": "hi", "top_p": 1.5}, 400, None),
    ({"prompt": "hi", "top_k": -2}, 400, None),
    ({"prompt": "hi", "min_p": 2}, 400, None),
    ({"prompt": "hi", "presence_penalty": 3}, 400, None),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, None),
    ({"prompt": "hi", "logprobs": 50}, 400, None),
    ({"prompt": "hi", "stop_token_ids": [49152]}, 400, None),
    ({"prompt": "hi", "stop": [1, 2]}, 400, "invalid_type"),
    ({"prompt": "hi", "seed": 2**70}, 400, None),
    ({"prompt": "hi", "logit_bias": {"49152": 1.0}}, 400, None),
    ({"prompt": "hi", "logit_bias": {"dog": 1.0}}, 400, None),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, None),
    ({"prompt": "hi", "logit_bias": {"5": "up"}}, 400, "invalid_type"),
    ({"prompt": "hi", "cache_salt": 7}, 400, "invalid_type"),
    ({"prompt": "hi", "cache_salt": ["a"]}, 400, "invalid_type"),
    ({"prompt": "hi", "cache_salt": ""}, 400, None),
    ({"prompt": "hi", "cache_salt": "s" * 257}, 400, None),
    ({"messages": []}, 400, "empty_prompt"),
    ({"messages": "hi"}, 400, "invalid_type"),
    ({"messages": [{"content": "hi"}]}, 400, "missing_field"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"messages": [{"role": "user", "content": ""}]}, 400, "empty_prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "unsupported"),
    ({"messages": CHAT, "top_logprobs": 3}, 400, None),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, None),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, None),
    ({"messages": [{"role": "user", "content": "x " * 9000}]}, 400, "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,code", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_input_is_a_clear_4xx(tokenizer, body, status, code):
    error = _error(tokenizer, body)
    assert error.status == status
    if code is not None:
        assert error.code == code
    assert error.message and error.body()["error"]["message"] == error.message


def test_wrong_type_names_the_field(tokenizer):
    error = _error(tokenizer, {"prompt": "hi", "top_p": "x"})
    assert error.param == "top_p" and "top_p" in error.message


def test_a_token_id_outside_the_vocabulary_is_named_as_vllm_words_it(tokenizer):
    error = _error(tokenizer, {"prompt": [5, 999999]})  # vLLM's tests match "out of vocabulary"
    assert error.param == "prompt" and "999999 is out of vocabulary" in error.message


def test_completion_defaults_follow_openai(tokenizer):
    p = _prepare(tokenizer, {"prompt": "Hello there"})
    assert p.kind == "completion" and p.prompt_token_ids == tokenizer.encode("Hello there")
    assert p.sampling.max_tokens == 16 and p.sampling.temperature == 1.0 and p.sampling.logprobs is None
    assert p.stop == [] and not p.stream


def test_completion_fields_map_to_sampling_params(tokenizer):
    p = _prepare(tokenizer, {"prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": -1,
                             "min_p": 0.1, "seed": 42, "stop": "END", "stop_token_ids": [2], "ignore_eos": True,
                             "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                             "repetition_penalty": 1.2, "priority": -3, "user": "alice",
                             "model": "SmolLM2-135M-Instruct",
                             "stream": True, "stream_options": {"include_usage": True},
                             "logit_bias": {"7": -100, "11": 2.5}})
    s = p.sampling
    assert s.logit_bias == {7: -100.0, 11: 2.5}
    assert p.prompt_token_ids == [1, 2, 3] and p.stop == ["END"] and p.priority == -3 and p.tenant == "alice"
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (7, 0.0, 0.5, 0, 0.1, 42)
    assert s.stop_token_ids == [2] and s.ignore_eos and s.logprobs == 2
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.stream and p.include_usage and p.model == "smollm2"


def test_speculative_decoding_is_on_unless_the_request_opts_out(tokenizer):
    assert _prepare(tokenizer, {"prompt": "hi"}).sampling.speculative_decoding is True
    assert _prepare(tokenizer, {"prompt": "hi", "speculative_decoding": False}).sampling.speculative_decoding is False
    chat = {"messages": CHAT, "speculative_decoding": False}
    assert _prepare(tokenizer, chat, ChatCompletionRequest).sampling.speculative_decoding is False


def test_chat_uses_the_template_and_defaults_to_the_rest_of_the_context(tokenizer):
    p = _prepare(tokenizer, {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                             "logprobs": True, "top_logprobs": 3, "stop": ["\n\n", ""]})
    assert p.kind == "chat"
    assert p.prompt_token_ids == tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "hi"}])
    assert p.sampling.max_tokens == 1024 and p.sampling.logprobs == 3 and p.stop == ["\n\n"]


def test_chat_max_completion_tokens_wins(tokenizer):
    p = _prepare(tokenizer, {"messages": CHAT, "max_tokens": 9, "max_completion_tokens": 4})
    assert p.sampling.max_tokens == 4


def test_body_kind_is_picked_by_messages_or_forced():
    assert isinstance(parse_body(b'{"prompt": "x"}'), CompletionRequest)
    assert isinstance(parse_body(b'{"messages": []}'), ChatCompletionRequest)
    with pytest.raises(ApiError):
        parse_body(b'{"prompt": "x"}', ChatCompletionRequest)


def test_unknown_fields_are_ignored(tokenizer):
    p = _prepare(tokenizer, {"prompt": "hi", "some_future_field": {"a": 1}, "max_tokens": 3})
    assert p.sampling.max_tokens == 3


def test_n_choices_up_to_max_n(tokenizer):
    from pagedserve.services.api.inputs import MAX_N

    body = parse_body(json.dumps({"prompt": "hi", "n": 3, "seed": 5, "temperature": 0.7}).encode())
    sampling = prepare(body, tokenizer, INFO).sampling  # every route serves up to MAX_N choices
    assert (sampling.n, sampling.seed) == (3, 5)  # choice i samples with seed + i (shared/parallel_sampling.py)
    assert MAX_N == 16 and prepare(parse_body(b'{"prompt": "hi", "n": 16}'), tokenizer, INFO).sampling.n == 16
    with pytest.raises(ApiError) as info:
        prepare(body, tokenizer, INFO, max_n=1)  # a route that serves one sequence
    assert (info.value.status, info.value.code, info.value.param) == (400, "unsupported", "n")


def test_cache_salt_is_bounded_and_prepared(tokenizer):
    from pagedserve.services.api.inputs import MAX_CACHE_SALT_CHARS

    assert _prepare(tokenizer, {"prompt": "hi"}).cache_salt == ""  # none: shared with every unsalted request
    salt = "s" * MAX_CACHE_SALT_CHARS
    assert _prepare(tokenizer, {"prompt": "hi", "cache_salt": salt}).cache_salt == salt
    assert _prepare(tokenizer, {"messages": CHAT, "cache_salt": "tenant-b"}).cache_salt == "tenant-b"
    for bad, message in (("", "got 0"), (salt + "s", f"got {MAX_CACHE_SALT_CHARS + 1}")):
        error = _error(tokenizer, {"prompt": "hi", "cache_salt": bad})
        assert (error.status, error.param) == (400, "cache_salt") and message in error.message
    error = _error(tokenizer, {"prompt": "hi", "cache_salt": 7})
    assert (error.status, error.code, error.param) == (400, "invalid_type", "cache_salt")


def test_min_tokens_is_bounded_by_max_tokens_and_free_of_grammars(tokenizer):
    assert _prepare(tokenizer, {"prompt": "hi", "max_tokens": 5, "min_tokens": 5}).sampling.min_tokens == 5
    assert _prepare(tokenizer, {"messages": CHAT, "min_tokens": 3}).sampling.min_tokens == 3
    for bad in ({"prompt": "hi", "max_tokens": 5, "min_tokens": 6}, {"prompt": "hi", "min_tokens": -1},
                {"prompt": "hi", "min_tokens": 2, "guided_regex": "a+"},
                {"messages": CHAT, "min_tokens": 2, "response_format": {"type": "json_object"}}):
        error = _error(tokenizer, bad)
        assert error.status == 400 and error.param == "min_tokens", bad
    assert _error(tokenizer, {"prompt": "hi", "min_tokens": "2"}).param == "min_tokens"
