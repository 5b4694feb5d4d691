"""Compile before schedule: a structured-output request waits until its worker reports its grammar
compiled (StepPlan.compile_grammars asks once, StepResult.compiled_grammars answers), so no step
stalls on a compile; past GRAMMAR_WAIT_S the worker compiles on demand: a lost plan only delays."""

from __future__ import annotations

import time

from pagedserve.shared.messages import GuidedDecoding

GRAMMAR_WAIT_S = 10.0
MAX_KNOWN_GRAMMARS = 4096  # compiled keys remembered (forgetting one only asks for it again)


class GrammarGate:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._compiled: set[str] = set()
        self.to_ask: dict[str, GuidedDecoding] = {}
        self._asked: dict[str, tuple[GuidedDecoding, float]] = {}

    def want(self, guided: GuidedDecoding | None) -> None:
        if guided is not None and guided.key not in self._compiled and guided.key not in self._asked:
            self.to_ask[guided.key] = guided

    def holds(self, guided: GuidedDecoding | None) -> bool:
        """Whether a request with this grammar must wait (asked, not reported, not timed out)."""
        if guided is None or not (self.to_ask or self._asked):
            return False
        key = guided.key
        if key in self.to_ask:
            return True
        asked = self._asked.get(key)
        if asked is None:
            return False
        if self._clock() - asked[1] < GRAMMAR_WAIT_S:
            return True
        self.compiled([key])  # not reported in time: the worker compiles it on demand
        return False

    def take_asks(self) -> list[GuidedDecoding]:
        asks, self.to_ask = list(self.to_ask.values()), {}
        now = self._clock()
        self._asked.update((g.key, (g, now)) for g in asks)
        return asks

    def compiled(self, keys: list[str]) -> None:
        if len(self._compiled) + len(keys) > MAX_KNOWN_GRAMMARS:
            self._compiled.clear()
        for key in keys:
            self._asked.pop(key, None)
            self._compiled.add(key)

    def worker_lost(self, waiting: list[GuidedDecoding | None]) -> None:
        """A new worker knows no grammar: ask again for those still asked and those of waiting requests."""
        self._compiled.clear()
        self.to_ask.update((g.key, g) for g, _ in self._asked.values())
        self._asked.clear()
        for guided in waiting:
            self.want(guided)
