"""shared/prompt_check: the checks the api's edge and the in-process engine share, with their words."""

from __future__ import annotations

import pytest

from pagedserve.shared.prompt_check import PromptRejected, check_context, check_prompt


@pytest.mark.parametrize(("ids", "message", "code"), [
    ([], "the prompt is empty", "empty_prompt"),
    ([3, 100, 7], "prompt token id 100 is out of vocabulary (ids 0..99)", "invalid_request"),
    ([-1], "prompt token id -1 is out of vocabulary (ids 0..99)", "invalid_request"),
])
def test_a_bad_prompt_is_rejected_naming_it(ids, message, code):
    with pytest.raises(PromptRejected) as caught:
        check_prompt(ids, vocab_size=100)
    assert (str(caught.value), caught.value.param, caught.value.code) == (message, "prompt", code)


@pytest.mark.parametrize(("args", "message", "param", "code"), [
    ((64, 1, 64, "messages"), "this model's maximum context length is 64 tokens; the messages alone have 64 tokens",
     "messages", "context_length_exceeded"),
    ((70, 1, 64, "prompt"), "this model's maximum context length is 64 tokens; the prompt alone has 70 tokens",
     "prompt", "context_length_exceeded"),
    ((60, 5, 64, "prompt"), "this model's maximum context length is 64 tokens; the prompt has 60 tokens and "
     "max_tokens asks for 5 more", "max_tokens", "context_length_exceeded"),
    ((3, 0, 64, "prompt"), "max_tokens must be at least 1, got 0", "max_tokens", "invalid_request"),
])
def test_a_request_past_the_context_is_rejected(args, message, param, code):
    with pytest.raises(PromptRejected) as caught:
        check_context(*args)
    assert (str(caught.value), caught.value.param, caught.value.code) == (message, param, code)


def test_a_fitting_request_passes():
    assert check_prompt([0, 99], vocab_size=100) is None
    assert check_context(60, 4, 64) is None
    assert isinstance(PromptRejected("x", "prompt"), ValueError)  # the engine's callers catch ValueError
