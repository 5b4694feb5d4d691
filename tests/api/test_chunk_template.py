"""ChunkTemplate: the plain streaming chunk cut once per stream gives byte for byte what
building and dumping the envelope gives, for any text."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedserve.services.api import openai_format as fmt
from pagedserve.services.api.generation import Output
from pagedserve.services.api.request import ApiRequest
from pagedserve.shared.messages import SamplingParams

TEXTS = ["hello", " world", "", 'say "hi"\\n', "a\nb\tc", "é中文😀", "\ue000", "</s>", "\x00\x1f"]


def _request(kind: str, n: int = 1, include_usage: bool = False, logprobs: int | None = None,
             continuous_usage: bool = False) -> ApiRequest:
    sampling = SamplingParams(logprobs=logprobs, n=n)
    request = ApiRequest(kind, "smollm2", f"{kind}-abc", [1, 2, 3], sampling, [], stream=True,
                         include_usage=include_usage, continuous_usage=continuous_usage, created=1_700_000_000)
    request.gens = [SimpleNamespace(sampling=sampling) for _ in range(n)]
    return request


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_template_matches_the_built_chunk(kind, include_usage, text):
    request = _request(kind, n=2, include_usage=include_usage)
    for index in (0, 1):
        out = Output(text, [7])
        built = fmt.sse(fmt.chat_chunk(request, index, out) if kind == "chat"
                        else fmt.completion_chunk(request, index, out, 0))
        assert fmt.ChunkTemplate(request, index).sse(text) == built
        assert json.loads(built[len(b"data: "):])["choices"][0]["index"] == index


@pytest.mark.parametrize(("options", "applies"), [
    ({}, True), ({"logprobs": 0}, False), ({"continuous_usage": True}, False), ({"include_usage": True}, True),
])
def test_only_plain_chunks_use_a_template(options, applies):
    assert fmt.ChunkTemplate.applies(_request("completion", **options)) is applies
