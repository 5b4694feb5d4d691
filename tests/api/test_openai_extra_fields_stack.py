"""A field neither OpenAI's nor ours (another server's extension, a typo) is accepted and
ignored, as vLLM does, and named in the pagedserve-ignored-fields header; through the openai
client on the real stack. (A field OpenAI defines and we cannot honour is a 400:
test_openai_compat_stack.py.)"""

from __future__ import annotations

import pydantic
import pytest

from pagedserve.services.api.openai_fields import IGNORED_HEADER, check_fields
from pagedserve.services.api.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.services.api.responses_api import chat_body

CHAT = [{"role": "user", "content": "Say hi"}]


def test_check_fields_names_what_it_ignores_and_nothing_it_serves():
    data = {"model": "m", "prompt": "hi", "echo": True, "use_beam_search": True, "truncate_prompt_tokens": 3}
    assert check_fields(data, CompletionRequest) == ["truncate_prompt_tokens", "use_beam_search"]
    chat = {"messages": CHAT, "metadata": {"a": "b"}, "store": False, "top_logprobs": 2, "chat_template_kwargs": {}}
    assert check_fields(chat, ChatCompletionRequest) == ["chat_template_kwargs"]

    responses = {"input": "hi", "store": True, "truncation": "disabled", "seed": 3, "metadata": {}, "foo": 1,
                 "service_tier": "auto"}
    assert chat_body(responses)[2] == ["foo", "service_tier"]


def test_the_responses_api_passes_the_speculation_opt_out_to_the_chat_path():
    chat, _, ignored = chat_body({"input": "hi", "speculative_decoding": False})
    assert chat["speculative_decoding"] is False and ignored == []
    with pytest.raises(pydantic.ValidationError, match="speculative_decoding"):
        ChatCompletionRequest.model_validate(chat_body({"input": "hi", "speculative_decoding": "no"})[0])


@pytest.mark.slow
def test_unknown_fields_are_served_and_named_in_a_header(oai):
    raw = oai.completions.with_raw_response.create(model="smollm2", prompt="hi", max_tokens=2, temperature=0,
                                                   extra_body={"use_beam_search": False, "foo": 1})
    assert raw.headers[IGNORED_HEADER] == "foo,use_beam_search"
    assert raw.parse().choices[0].finish_reason == "length"
    raw = oai.chat.completions.with_raw_response.create(model="smollm2", messages=CHAT, max_tokens=2, stream=True,
                                                        extra_body={"bad_words": []})
    assert raw.headers[IGNORED_HEADER] == "bad_words"
    assert [c.choices[0].finish_reason for c in raw.parse() if c.choices][-1] == "length"
    plain = oai.chat.completions.with_raw_response.create(model="smollm2", messages=CHAT, max_tokens=2)
    assert IGNORED_HEADER not in plain.headers


@pytest.mark.slow
def test_the_responses_api_names_its_ignored_fields_in_the_header_too(oai):
    raw = oai.responses.with_raw_response.create(model="smollm2", input="hi", max_output_tokens=2, store=True,
                                                 extra_body={"use_beam_search": False, "foo": 1})
    assert raw.headers[IGNORED_HEADER] == "foo,use_beam_search" and raw.parse().status == "incomplete"
    raw = oai.responses.with_raw_response.create(model="smollm2", input="hi", max_output_tokens=2, stream=True,
                                                 extra_body={"bad_words": []})
    assert raw.headers[IGNORED_HEADER] == "bad_words"
    assert [e.type for e in raw.parse()][-1] == "response.incomplete"
    plain = oai.responses.with_raw_response.create(model="smollm2", input="hi", max_output_tokens=2, store=True)
    assert IGNORED_HEADER not in plain.headers


@pytest.mark.slow
def test_every_streamed_chat_delta_has_string_content(oai):
    """The finishing chunk too (its content "" when the last token has no text), as vLLM sends it:
    SGLang's and vLLM's stream tests read delta.content of every chunk as a string."""
    chunks = list(oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=40, temperature=0,
                                              stream=True))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert all(isinstance(c.delta.content, str) for c in choices)
    assert [c.finish_reason is not None for c in choices].count(True) == 1 and choices[-1].finish_reason


@pytest.mark.slow
def test_logprobs_of_masked_tokens_are_floored_as_openai_does(oai):
    """A token the grammar masks has logprob -inf, which JSON cannot carry: it is reported as
    -9999.0, OpenAI's floor (vLLM's test_structured_outputs_choice_chat_logprobs)."""
    choices = ["Python", "Java"]
    r = oai.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=5,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices
    scores = [t.logprob for step in r.choices[0].logprobs.content for t in step.top_logprobs]
    assert min(scores) == -9999.0  # the last step: only the end is allowed
