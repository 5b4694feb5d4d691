"""One sequence of a request: its tokens, text and finish as the scheduler's deltas give them,
queued for whoever streams it here and turned into record events (records.py). It sends nothing:
what the scheduler must be told (abort_why) the live table (live_table.py) hands to the loop.

Its request (request.py) holds what the client asked; a sequence holds only its own state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.services.api.detokenizer import Detokenizer
from pagedserve.services.api.metrics import ApiMetrics
from pagedserve.shared.messages import RequestDelta, SampledToken, SubmitRequest
from pagedserve.shared.parallel_sampling import child_sampling

if TYPE_CHECKING:
    from pagedserve.services.api.request import ApiRequest

log = logging.getLogger("pagedserve.api")


@dataclass
class Output:
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    seq: int = 0  # the record event it was written as: the client's resume cursor
    error: str | None = None  # why, for finish_reason "error"

    def followed_by(self, later: Output) -> Output:
        """This output and the next of the same sequence as one."""
        return Output(self.text + later.text, self.token_ids + later.token_ids, self.logprobs + later.logprobs,
                      later.finish_reason, later.seq, later.error)


class Outputs(deque):
    """A sequence's Outputs not read yet, for its one reader (asyncio.Queue's work without its
    getters' bookkeeping: the api puts one per token of every stream)."""

    def __init__(self) -> None:
        super().__init__()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, out: Output) -> None:
        self.append(out)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        while not self:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class Generation:
    def __init__(self, request: ApiRequest, index: int, sequence_id: str, api_id: str, tokenizer,
                 metrics: ApiMetrics, listen: bool = True):
        self.request = request
        self.index = index
        self.sequence_id = sequence_id  # its id at the scheduler (n == 1: the request's)
        self.sampling = child_sampling(request.sampling, index)  # n=1, seed + index
        self.api_id = api_id  # the api whose delta stream its submission names
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._text_parts: list[str] = []
        self.num_chars = 0  # len(self.text), without joining
        self.token_ids: list[int] = []
        self.logprobs: list[SampledToken] = []
        self.finish_reason: str | None = None
        self.why: str | None = None  # what ended it, for logs and callers ("client disconnected", ...)
        self.abort_why: str | None = None  # set when it ended here first: the scheduler must abort it
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.prompt_logprobs: dict[int, SampledToken] = {}  # prompt index -> its logprob (from 1), as computed
        self.prompt_ranks: dict[int, int] = {}  # prompt index -> its token's rank in the model's distribution
        self._detok = Detokenizer(tokenizer, request.prompt_token_ids, request.stop,
                                  min_tokens=request.sampling.min_tokens)
        self.outputs: Outputs | None = Outputs() if listen else None  # None: nobody listens here
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text released so far (a join, so a long output is not quadratic to build)."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": len(self.token_ids),
                 "total_tokens": self.num_prompt_tokens + len(self.token_ids)}
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def submit_message(self) -> SubmitRequest:
        """Its submission; with the tokens it has so far (a resubmission resumes there)."""
        r = self.request
        return SubmitRequest(request_id=self.sequence_id, api_id=self.api_id,
                             prompt_token_ids=r.prompt_token_ids, sampling=self.sampling, arrival_time=time.time(),
                             priority=r.priority, tenant=r.tenant, cache_salt=r.cache_salt,
                             output_token_ids=list(self.token_ids))

    async def next(self) -> Output | None:
        """The next output, or None once finished. Outputs queued meanwhile come merged into one: a
        reader that fell behind catches up in one write (as vLLM's output collector merges deltas)."""
        outputs = self.outputs
        if outputs is None or not outputs and self.finished:
            return None
        if not outputs:
            await outputs.wait()
        out = outputs.popleft()
        while out.finish_reason is None and outputs:
            out = out.followed_by(outputs.popleft())
        return out

    def replay(self, token_ids: list[int]) -> None:
        """An adopted sequence: feed the tokens of one recorded event, as they came then."""
        step = self._detok.add(list(token_ids))
        self.token_ids.extend(token_ids)
        if step.text:
            self._text_parts.append(step.text)
            self.num_chars += len(step.text)

    def apply(self, delta: RequestDelta) -> Output | None:
        """The Output of a delta (None: it repeats what was applied already)."""
        if delta.prompt_logprobs is not None:
            first = delta.prompt_logprobs.first
            for i, token in enumerate(delta.prompt_logprobs.tokens):
                self.prompt_logprobs.setdefault(first + i, token)  # a recomputed chunk repeats them
            for i, rank in enumerate(delta.prompt_logprobs.ranks):
                self.prompt_ranks.setdefault(first + i, rank)
            if not delta.new_token_ids and delta.finish_reason is None:
                return None
        now = time.monotonic()
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        ids = list(delta.new_token_ids)
        start = delta.num_output_tokens - len(ids)
        if ids and start != len(self.token_ids):
            if start > len(self.token_ids):
                return self.fail(f"tokens {len(self.token_ids)}..{start - 1} were lost on the way")
            ids = ids[len(self.token_ids) - start:]  # a resend: keep only what is new
            if not ids and delta.finish_reason is None:
                return None
        if ids and (min(ids) < 0 or max(ids) >= self.tokenizer.vocab_size):
            log.error("sequence %s: token id out of range in a delta; ending it", self.sequence_id)
            return self.fail("bad token id on the wire")
        finish = delta.finish_reason
        step = self._detok.add(ids, finished=finish is not None)
        if step.stopped:
            if finish is None:
                self.abort_why = "stop string"
            finish = "stop"
        self.token_ids.extend(ids)
        logprobs = delta.logprobs[-len(ids):] if ids and delta.logprobs else []
        self.logprobs.extend(logprobs)
        if step.text:
            self._text_parts.append(step.text)
            self.num_chars += len(step.text)
        if ids:
            if self._last_token_time is None:
                self.metrics.time_to_first_token.observe(now - self._arrival)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        if finish is not None:
            self.finish(finish, "stop string" if step.stopped else finish)
        return Output(step.text, ids, logprobs, finish)

    def fail(self, error: str) -> Output:
        """End it with finish_reason "error": it cannot go on (to abort at the scheduler)."""
        log.error("sequence %s cannot go on: %s", self.sequence_id, error)
        self.abort_why = error
        self.finish("error", error)
        return Output("", [], finish_reason="error", error=error)

    def event(self, out: Output) -> dict:
        """The record event of an Output it just gave (records.py)."""
        event = {"index": self.index, "text": out.text, "token_ids": out.token_ids,
                 "text_offset": self.num_chars - len(out.text), "token_offset": len(self.token_ids) - len(out.token_ids)}
        if self.sampling.logprobs is not None and out.logprobs:
            event["logprobs"] = [{"token_id": s.token_id, "logprob": s.logprob, "top_logprobs": s.top_logprobs}
                                 for s in out.logprobs]
        if out.finish_reason is not None:
            event.update(finish_reason=out.finish_reason, usage=self.usage())
            if out.error:
                event["error"] = out.error
        return event

    def snapshot_event(self) -> dict:
        """Everything so far as one event from offset 0 (a record rewritten after a Redis restart)."""
        out = Output(self.text, list(self.token_ids), finish_reason=self.finish_reason)
        return {**self.event(out), "text_offset": 0, "token_offset": 0}

    def finish(self, reason: str, why: str) -> None:
        self.finish_reason, self.why = reason, why
        self.metrics.e2e_request_latency.observe(time.monotonic() - self._arrival)
        self.metrics.request_success.labels(finished_reason=reason).inc()
        log.info("sequence %s finished (%s): %d prompt + %d output tokens in %.3fs", self.sequence_id, why,
                 self.num_prompt_tokens, len(self.token_ids), time.monotonic() - self._arrival)
