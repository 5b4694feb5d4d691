"""The n-gram (prompt lookup) proposer: exact drafts on hand-made token lists, and against a plain
reference on any list (hypothesis): the longest recurring suffix in [min_n, max_n], its earliest
earlier occurrence, at most k of the tokens after it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.services.scheduler.ngram_proposer import propose_ngram


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_vllm_example_proposes_what_followed_the_bigram():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]


def test_the_longest_matching_ngram_wins_over_an_earlier_shorter_one():
    # the bigram (8, 9) first recurs at 0 (followed by 5), the trigram (7, 8, 9) at 4 (followed by 6)
    tokens = [8, 9, 5, 0, 7, 8, 9, 6, 1, 7, 8, 9]
    assert propose_ngram(tokens, 2, 3, 2) == [6, 1]
    assert propose_ngram(tokens, 2, 2, 2) == [5, 0]


def test_the_earliest_occurrence_is_used_and_drafts_stop_at_the_end():
    assert propose_ngram([4, 5, 1, 4, 5, 2, 4, 5], 2, 2, 1) == [1]
    assert propose_ngram([3, 3, 3], 1, 1, 5) == [3, 3]  # a match may run into the suffix itself


def test_nothing_recurs_or_too_short_no_drafts():
    assert propose_ngram([1, 2, 3, 4, 5], 1, 3, 4) == []
    assert propose_ngram([1, 2, 1, 3], 2, 4, 4) == []  # only a 1-gram recurs
    assert propose_ngram([7], 1, 1, 3) == []


@pytest.mark.parametrize("args", [(0, 1, 1), (2, 1, 1), (1, 1, 0)])
def test_bad_bounds_are_refused(args):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1, 2], *args)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=60), min_n=st.integers(1, 4), extra=st.integers(0, 3),
       k=st.integers(1, 6))
def test_drafts_equal_the_reference_and_continue_a_recurring_suffix(tokens, min_n, extra, k):
    max_n = min_n + extra
    drafts = propose_ngram(tokens, min_n, max_n, k)
    assert drafts == reference(tokens, min_n, max_n, k)
    assert len(drafts) <= k
    if drafts:  # some suffix of length n in range recurs right before what is drafted
        assert any(tokens[s:s + n] == tokens[-n:] and tokens[s + n:s + n + len(drafts)] == drafts
                   for n in range(min_n, max_n + 1) for s in range(len(tokens) - n))
