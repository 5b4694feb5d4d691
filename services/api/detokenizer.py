"""Incremental detokenization and stop strings: token ids in, safe text chunks out.

A chunk never splits a UTF-8 character (no trailing U+FFFD) and never holds any part of a
stop string (a possible prefix is held back). vLLM-style read offset over a window: O(window) per step.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTEXT_TOKENS = 5  # prompt tokens used as left context for the first output tokens
_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Token ids -> newly completed text, never ending inside a UTF-8 character. Holds only its
    window (the last released step as context, then what is not released yet): the tokens
    themselves are the Generation's."""

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids or [])[-_CONTEXT_TOKENS:]
        if context and _REPLACEMENT in self._decode(context):
            context = []  # a prompt ending inside a character: no context beats a misaligned one
        self._window: list[int] = context
        self._read_offset = len(context)  # the window's tokens before this were already released

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text they complete ('' while a character is open)."""
        self._window.extend(token_ids)
        prefix_text = self._decode(self._window[:self._read_offset])
        full_text = self._decode(self._window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete: wait
        del self._window[:self._read_offset]  # what was released becomes the next step's context
        self._read_offset = len(self._window)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is still held (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._window[:self._read_offset])
        full_text = self._decode(self._window)
        self._window, self._read_offset = [], 0
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""


class StopStringMatcher:
    """Text chunks in, text safe to emit out; reports the first stop string seen."""

    def __init__(self, stop: list[str] | None):
        self.stop = list(stop or [])  # non-empty: inputs.prepare drops empty ones
        self._held = ""  # text that may be the start of a stop string
        self.stopped = False

    def add(self, text: str) -> str:
        if self.stopped or not text and not self._held:
            return ""
        if not self.stop:
            return text
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[:min(hits)]
        keep = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """The generation ended without a stop string: the held text was never one."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest tail of buffer that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buffer)), best, -1):
                if buffer.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass
class DetokenizedStep:
    text: str  # safe to emit now
    stopped: bool  # a stop string was found; nothing more will ever be emitted


class Detokenizer:
    """IncrementalDecoder + StopStringMatcher for one request."""

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None, stop: list[str] | None = None,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self._decoder = IncrementalDecoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self._matcher = StopStringMatcher(stop)
        self._unchecked = min_tokens  # vLLM's min_tokens: the text of this many first tokens is never searched

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def add(self, token_ids: list[int], finished: bool = False) -> DetokenizedStep:
        """Feed one step's tokens; `finished`: the scheduler ended the request with them."""
        if self._matcher.stopped:
            return DetokenizedStep("", True)
        text = ""
        if self._unchecked:
            early, token_ids = token_ids[:self._unchecked], token_ids[self._unchecked:]
            self._unchecked -= len(early)
            text = self._decoder.add(early)
        if token_ids or not text:
            text += self._matcher.add(self._decoder.add(token_ids))
        if finished and not self._matcher.stopped:
            text += self._matcher.add(self._decoder.flush())
            if not self._matcher.stopped:
                text += self._matcher.flush()
        return DetokenizedStep(text, self._matcher.stopped)
