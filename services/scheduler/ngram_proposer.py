"""Prompt lookup (n-gram) drafts, as vLLM's NgramProposer: the longest suffix of the request's tokens,
between min_n and max_n long, that also occurs earlier; the drafts are the (at most k) tokens that
followed its earliest earlier occurrence. Pure Python, no model, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Draft tokens for `tokens` (prompt + output so far); [] if no n-gram of min_n..max_n recurs."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"propose_ngram: k={k}, min_n={min_n}, max_n={max_n}")
    length = len(tokens)
    tokens = list(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        start = _earliest(tokens, tokens[length - n:], length - n)
        if start is not None:
            return tokens[start + n:start + n + k]
    return []


def _earliest(tokens: list[int], pattern: list[int], end: int) -> int | None:
    """First i < end with tokens[i:i + len(pattern)] == pattern (the match may run into the suffix)."""
    first, n = pattern[0], len(pattern)
    i = 0
    while True:
        try:
            i = tokens.index(first, i, end)
        except ValueError:
            return None
        if tokens[i:i + n] == pattern:
            return i
        i += 1
