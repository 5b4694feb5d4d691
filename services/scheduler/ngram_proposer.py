"""Prompt lookup (n-gram) drafts, as vLLM's NgramProposer: the longest suffix of the request's tokens,
between min_n and max_n long, that also occurs earlier; the drafts are the (at most k) tokens that
followed its earliest earlier occurrence. Pure Python, no model, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Draft tokens for `tokens` (prompt + output so far); [] if no n-gram of min_n..max_n recurs.

    One pass over the earlier occurrences of the last token: each is the end of a match as long as
    the common suffix there (capped at max_n); the longest wins, the earliest among equals."""
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"propose_ngram: k={k}, min_n={min_n}, max_n={max_n}")
    tokens = tokens if isinstance(tokens, list) else list(tokens)
    length = len(tokens)
    if length < 2:
        return []
    last, best_n, best_end = tokens[-1], 0, -1
    end = -1
    while True:
        try:
            end = tokens.index(last, end + 1, length - 1)
        except ValueError:
            break
        n = 1
        while n < max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_end = n, end
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return tokens[best_end + 1:best_end + 1 + k]
