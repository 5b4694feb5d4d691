"""Incremental detokenization and stop strings, with the real SmolLM2 tokenizer.

Properties checked: the concatenated chunks equal the full decode; no chunk ever ends
inside a UTF-8 character (no U+FFFD) whatever the token grouping; a stop string spanning
tokens is cut exactly and nothing after it (nor any prefix of it) is ever emitted.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.services.api.detokenizer import Detokenizer, IncrementalDecoder, StopStringMatcher
from pagedserve.services.api.inputs import ModelInfo, prepare
from pagedserve.services.api.protocol import parse_body

MULTIBYTE = "Hello 😀 世界 ok 🎉🎉 naïve x👩‍👩‍👧y"
_ALPHABET = st.sampled_from(list("ab c.,\n") + ["é", "世", "界", "😀", "🎉", "ї", " the", "STOP"])


def _stream(detok: Detokenizer, ids: list[int], groups: list[int] | None = None) -> tuple[list[str], bool]:
    """Feed ids in groups of the given sizes (1 by default); the last group finishes."""
    chunks, i, sizes = [], 0, iter(groups or [])
    while i < len(ids):
        n = max(1, next(sizes, 1))
        batch, i = ids[i:i + n], i + n
        step = detok.add(batch, finished=i >= len(ids))
        chunks.append(step.text)
        if step.stopped:
            break
    return chunks, detok.stopped


def test_multibyte_characters_spread_over_tokens_are_never_split(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    single = [tokenizer.decode([i]) for i in ids]
    assert sum("\ufffd" in s for s in single) >= 4, "the test string must put characters across several tokens"
    chunks, stopped = _stream(Detokenizer(tokenizer), ids)
    assert not stopped
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == MULTIBYTE
    assert sum(1 for c in chunks if c) > 5  # it did stream, not release everything at the end


def test_decoder_with_prompt_context_matches_full_decode(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tokenizer.encode(" Sure! 世界 is 'world' 🌍.")
    decoder = IncrementalDecoder(tokenizer, prompt)
    text = "".join(decoder.add([i]) for i in ids) + decoder.flush()
    assert text == tokenizer.decode(ids)


def test_unfinished_character_at_the_end_is_flushed_as_replacement(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = Detokenizer(tokenizer)
    text = "".join(detok.add([i]).text for i in ids[:-1])
    assert "\ufffd" not in text
    text += detok.add([], finished=True).text
    assert text == tokenizer.decode(ids[:-1])


def test_stop_string_spanning_tokens_is_cut_exactly(tokenizer):
    text = "The answer is forty-two. STOP here and more"
    ids = tokenizer.encode(text)
    assert not any("STOP" in tokenizer.decode([i]) for i in ids), "STOP must span tokens"
    chunks, stopped = _stream(Detokenizer(tokenizer, stop=["STOP"]), ids)
    assert stopped
    assert "".join(chunks) == "The answer is forty-two. "
    assert not any("ST" in c for c in chunks)  # not even the stop string's first token leaked


def test_nothing_is_emitted_after_a_stop(tokenizer):
    detok = Detokenizer(tokenizer, stop=[" here"])
    ids = tokenizer.encode("a b here c d")
    chunks, stopped = _stream(detok, ids)
    assert stopped and "".join(chunks) == "a b"
    assert detok.add(tokenizer.encode(" more text"), finished=True).text == ""


def test_stop_string_made_of_a_multibyte_character(tokenizer):
    ids = tokenizer.encode("abc 🎉 def")
    chunks, stopped = _stream(Detokenizer(tokenizer, stop=["🎉"]), ids)
    assert stopped and "".join(chunks) == "abc "


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    detok = Detokenizer(tokenizer, stop=["Hello world"])
    ids = tokenizer.encode("Say Hello there")
    emitted = []
    for i in ids[:-1]:
        emitted.append(detok.add([i]).text)
    assert "".join(emitted) == "Say "  # "Hello" could start the stop string: held
    emitted.append(detok.add([ids[-1]], finished=True).text)
    assert "".join(emitted) == "Say Hello there"


def test_the_earliest_completed_stop_string_wins():
    matcher = StopStringMatcher(["abcd", "bc"])
    out = matcher.add("a") + matcher.add("b") + matcher.add("c")
    assert matcher.stopped and out == "a"
    assert matcher.add("d") == "" and matcher.flush() == ""


def test_empty_stop_strings_are_ignored(tokenizer):
    """Dropped once at the edge (inputs.prepare); the matcher gets only the others."""
    info = ModelInfo(served_name="smollm2", max_model_len=2048, vocab_size=tokenizer.vocab_size)
    request = prepare(parse_body(b'{"prompt": "hi", "stop": ["", "zz"]}'), tokenizer, info)
    matcher = StopStringMatcher(request.stop)
    assert request.stop == ["zz"] and matcher.add("abc") == "abc" and not matcher.stopped


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_ALPHABET, min_size=1, max_size=25), stop_src=st.lists(_ALPHABET, min_size=1, max_size=3),
       groups=st.lists(st.integers(1, 4), max_size=30), use_stop=st.booleans())
def test_streaming_equals_cutting_the_full_text(tokenizer, pieces, stop_src, groups, use_stop):
    text = "".join(pieces)
    stop = "".join(stop_src)
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    detok = Detokenizer(tokenizer, stop=[stop] if use_stop else None)
    chunks, stopped = _stream(detok, ids, groups)
    assert all("\ufffd" not in c for c in chunks)
    cut = full.find(stop) if use_stop else -1
    expected = full if cut < 0 else full[:cut]
    assert stopped == (cut >= 0)
    assert "".join(chunks) == expected


def test_stop_strings_are_not_searched_in_the_first_min_tokens_tokens(tokenizer):
    ids = tokenizer.encode("a b here c d here e")
    first = len(tokenizer.encode("a b here"))
    chunks, stopped = _stream(Detokenizer(tokenizer, stop=[" here"], min_tokens=first), ids)
    assert stopped and "".join(chunks) == "a b here c d"
    chunks, stopped = _stream(Detokenizer(tokenizer, stop=[" here"], min_tokens=first), ids, [len(ids)])
    assert stopped and "".join(chunks) == "a b here c d"  # one step across the boundary
