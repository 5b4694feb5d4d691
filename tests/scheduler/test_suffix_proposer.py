"""Suffix decoding drafts: exact cases for matching, frequency, adaptive length and the output cache."""

from __future__ import annotations

import pytest

from pagedserve.services.scheduler.suffix_proposer import SuffixProposer


def proposer(factor: float = 1.0, min_prob: float = 0.1, cached: int = 8, depth: int = 24) -> SuffixProposer:
    return SuffixProposer(depth, factor, min_prob, cached)


def test_nothing_recurs_no_drafts():
    assert proposer().propose([1, 2, 3, 4], 4) == []
    assert proposer().propose([7], 4) == []


def test_copies_after_the_match_at_most_match_length_times_factor():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert proposer().propose(tokens, 8) == [4, 5, 9]
    assert proposer().propose(tokens, 2) == [4, 5]
    assert proposer(factor=2.0).propose(tokens, 8) == [4, 5, 9, 1, 2, 3]
    assert proposer(depth=2).propose(tokens, 8) == [4, 5]


def test_the_most_frequent_continuation_while_its_share_holds():
    tokens = [7, 8, 0, 7, 8, 1, 7, 9, 2, 7]
    assert proposer().propose(tokens, 4) == [8]
    assert proposer(factor=2.0).propose(tokens, 4) == [8, 0]  # 8 in 2 of 3, then 0 or 1: 1/3
    assert proposer(factor=2.0, min_prob=0.5).propose(tokens, 4) == [8]
    assert proposer(min_prob=0.7).propose(tokens, 4) == []


def test_a_long_unique_match_beats_a_short_frequent_one():
    tokens = [1, 2, 3, 4, 9, 3, 5, 9, 3, 5, 2, 3]
    assert proposer().propose(tokens, 4) == [4, 9]


def test_finished_outputs_are_drafted_from_bounded_by_the_cache():
    sp = proposer(cached=1)
    sp.remember([5, 6, 7, 8, 9, 10, 11])
    assert sp.propose([1, 5, 6, 7, 8], 3) == [9, 10, 11]
    assert sp.propose([1, 3, 7, 8], 3) == [9, 10]  # a bigram's match drafts two
    assert sp.propose([1, 3, 4, 8], 3) == []  # shorter than a cache key
    sp.remember([20, 21, 22, 23, 24, 25])
    assert sp.propose([1, 5, 6, 7, 8], 3) == []  # evicted
    assert sp.propose([3, 20, 21, 22, 23], 3) == [24, 25]
    assert sp.index.keys() == {(20, 21), (21, 22), (22, 23), (23, 24)}


def test_no_cache_remembers_nothing():
    sp = proposer(cached=0)
    sp.remember([5, 6, 7, 8, 9, 10])
    assert sp.propose([1, 5, 6, 7, 8], 3) == [] and not sp.index


def test_k_below_one_is_a_caller_bug():
    with pytest.raises(ValueError):
        proposer().propose([1, 1], 0)
