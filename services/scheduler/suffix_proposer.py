"""Suffix decoding drafts (`"method": "suffix"`, as vLLM and Arctic Inference define it), pure Python.

The pattern, a suffix of the request's tokens up to max_depth long, is matched in its own prompt and
output and in earlier requests' outputs (the cache, from a bigram on); the draft follows the most
frequent next token while the share of occurrences agreeing with it stays >= min_prob, for at most
max_spec_factor x the match length. Of all match lengths the largest expected accepted length wins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

CACHE_KEY = 2  # a match in the cache is at least this long: cached outputs are indexed by their bigrams
CACHE_HITS_PER_KEY = 32  # the most recent occurrences kept per key


def _match(seq: Sequence[int], end: int, tokens: Sequence[int], max_depth: int) -> int:
    """How many tokens before and at seq[end] equal the end of tokens (at most max_depth)."""
    n, length = 0, len(tokens)
    while n < max_depth and n <= end and seq[end - n] == tokens[length - 1 - n]:
        n += 1
    return n


def _own_occurrences(tokens: list[int], max_depth: int) -> list[tuple[int, list[int], int]]:
    """(match length, tokens, end) of each earlier place the request's last token occurs."""
    found, last, end = [], tokens[-1], -1
    while True:
        try:
            end = tokens.index(last, end + 1, len(tokens) - 1)
        except ValueError:
            return found
        found.append((_match(tokens, end, tokens, max_depth), tokens, end))


def _follow(starts: list[tuple[list[int], int]], limit: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path from the continuation points `starts`: (draft, expected accepted length)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    active = starts
    while len(draft) < limit and active:
        counts: dict[int, int] = {}
        for seq, p in active:
            if p < len(seq):
                counts[seq[p]] = counts.get(seq[p], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # ties: the one met first
        prob *= counts[token] / len(active)
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        active = [(seq, p + 1) for seq, p in active if p < len(seq) and seq[p] == token]
    return draft, score


class SuffixProposer:
    """Drafts for one scheduler's requests; remember() adds a finished request's output to the cache."""

    def __init__(self, max_depth: int, max_spec_factor: float, min_prob: float, max_cached: int) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_prob = min_prob
        self.cache: deque[list[int]] = deque(maxlen=max_cached)
        self.index: dict[tuple[int, ...], deque[tuple[list[int], int]]] = {}

    def remember(self, output_token_ids: Sequence[int]) -> None:
        if not self.cache.maxlen or len(output_token_ids) <= CACHE_KEY:
            return
        if len(self.cache) == self.cache.maxlen:
            self._forget(self.cache[0])
        seq = list(output_token_ids)
        self.cache.append(seq)
        for end in range(CACHE_KEY - 1, len(seq) - 1):
            key = tuple(seq[end + 1 - CACHE_KEY:end + 1])
            self.index.setdefault(key, deque(maxlen=CACHE_HITS_PER_KEY)).append((seq, end))

    def _forget(self, seq: list[int]) -> None:
        for end in range(CACHE_KEY - 1, len(seq) - 1):
            key = tuple(seq[end + 1 - CACHE_KEY:end + 1])
            hits = self.index.get(key)
            if hits is not None:
                kept = [(s, e) for s, e in hits if s is not seq]
                if kept:
                    self.index[key] = deque(kept, maxlen=CACHE_HITS_PER_KEY)
                else:
                    del self.index[key]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts after `tokens` (prompt + output so far); [] when nothing recurs."""
        if k < 1:
            raise ValueError(f"propose: k={k}")
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if len(tokens) < 2:
            return []
        found = _own_occurrences(tokens, self.max_depth)
        for seq, end in self.index.get(tuple(tokens[-CACHE_KEY:]), ()):
            found.append((_match(seq, end, tokens, self.max_depth), seq, end))
        best: list[int] = []
        best_score = 0.0
        for m in sorted({n for n, _, _ in found}, reverse=True):
            limit = min(k, int(m * self.max_spec_factor))
            if limit <= best_score:  # its score is at most limit: it cannot win
                continue
            draft, score = _follow([(seq, end + 1) for n, seq, end in found if n >= m], limit, self.min_prob)
            if score > best_score:
                best, best_score = draft, score
        return best
