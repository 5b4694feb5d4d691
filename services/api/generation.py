"""One sequence's life in the api that writes its record: deltas in, safe text out.

A repeated delta is trimmed by its offset. Whoever listens must `close()` it (try/finally):
a sequence not finished by then is aborted, so a departed client never leaves blocks behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from pagedserve.services.api.admission import check_limits
from pagedserve.services.api.detokenizer import Detokenizer
from pagedserve.services.api.inputs import Prepared
from pagedserve.services.api.loop import ApiLoop
from pagedserve.services.api.metrics import ApiMetrics
from pagedserve.services.api.protocol import ApiError
from pagedserve.shared.messages import RequestDelta, SampledToken, SubmitRequest

log = logging.getLogger("pagedserve.api")


@dataclass
class Output:
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    seq: int = 0  # the record event it was written as: the client's resume cursor
    error: str | None = None  # why, for finish_reason "error"


def unavailable(error: Exception) -> ApiError:
    return ApiError(503, f"the server cannot take requests right now: {error}", code="unavailable",
                    type="service_unavailable")


class Generation:
    def __init__(self, loop: ApiLoop, tokenizer, prepared: Prepared, metrics: ApiMetrics, request_id: str,
                 record_id: str | None = None, index: int = 0):
        self.loop = loop
        self.tokenizer = tokenizer
        self.prepared = prepared
        self.metrics = metrics
        self.request_id = request_id  # the sequence's id at the scheduler
        self.record_id = record_id or request_id  # the request's (n > 1: the parent's)
        self.index = index
        self.created = int(time.time())
        self._text_parts: list[str] = []
        self.num_chars = 0  # len(self.text), without joining
        self.token_ids: list[int] = []
        self.logprobs: list[SampledToken] = []
        self.finish_reason: str | None = None
        self.why: str | None = None  # what ended it, for logs and callers ("client disconnected", ...)
        self.num_prompt_tokens = len(prepared.prompt_token_ids)
        self.num_cached_tokens = 0
        self._detok = Detokenizer(tokenizer, prepared.prompt_token_ids, prepared.stop)
        self.outputs: asyncio.Queue | None = asyncio.Queue()  # None: nobody listens here (REST)
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text released so far (a join, so a long output is not quadratic to build)."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def started(self) -> bool:
        return self.first_token_time is not None

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": len(self.token_ids),
                 "total_tokens": self.num_prompt_tokens + len(self.token_ids)}
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def check_admission(self) -> None:
        """ApiError(400) past a per-request limit, 429 when the queue is closed to this tenant."""
        p = self.prepared
        admission = self.loop.admission
        check_limits(admission.limits, len(p.prompt_token_ids), p.sampling.max_tokens,
                     "messages" if p.kind == "chat" else "prompt")
        admission.check(p.tenant)

    def submit_message(self) -> SubmitRequest:
        """Its submission; with the tokens it has so far (a resubmission resumes there)."""
        p = self.prepared
        return SubmitRequest(request_id=self.request_id, api_id=self.loop.api_id,
                             prompt_token_ids=p.prompt_token_ids, sampling=p.sampling, arrival_time=time.time(),
                             priority=p.priority, tenant=p.tenant, cache_salt=p.cache_salt,
                             output_token_ids=list(self.token_ids))

    async def next(self, timeout: float | None = None) -> Output | None:
        """The next output, or None once finished; TimeoutError if none came in `timeout`."""
        if self.outputs is None:
            return None
        if not self.outputs.empty():  # the common case while streaming: no task, no timer
            out = self.outputs.get_nowait()
        elif self.finished:
            return None
        elif timeout is None:
            out = await self.outputs.get()
        else:
            out = await asyncio.wait_for(self.outputs.get(), timeout)
        return out

    def abort(self, reason: str = "abort") -> None:
        """End it now: abort at the scheduler, record finish 'abort'."""
        if self.finished:
            return
        self.loop.end(self, "abort", reason)

    def close(self, reason: str = "client went away") -> None:
        self.abort(reason)

    def replay(self, token_ids: list[int]) -> None:
        """An adopted sequence: feed the tokens of one recorded event, as they came then."""
        step = self._detok.add(list(token_ids))
        self.token_ids.extend(token_ids)
        if step.text:
            self._text_parts.append(step.text)
            self.num_chars += len(step.text)

    def apply(self, delta: RequestDelta) -> Output | None:
        """The Output of a delta (None: it repeats what was applied already)."""
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
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            log.error("request %s: token id out of range in a delta; ending it", self.request_id)
            return self.fail("bad token id on the wire")
        finish = delta.finish_reason
        step = self._detok.add(ids, finished=finish is not None)
        if step.stopped:
            if finish is None:
                self.loop.abort(self.request_id, "stop string")
            finish = "stop"
        self.token_ids.extend(ids)
        logprobs = list(delta.logprobs)[-len(ids):] if ids else []
        self.logprobs.extend(logprobs)
        if step.text:
            self._text_parts.append(step.text)
            self.num_chars += len(step.text)
        if ids:
            if self._last_token_time is None:
                self.first_token_time = now
                self.metrics.time_to_first_token.observe(now - self._arrival)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        if finish is not None:
            self._finish(finish, "stop string" if step.stopped else finish)
        return Output(step.text, ids, logprobs, finish)

    def fail(self, error: str) -> Output:
        """End it with finish_reason "error": it cannot go on (aborted at the scheduler)."""
        log.error("request %s cannot go on: %s", self.request_id, error)
        self.loop.abort(self.request_id, error)
        self._finish("error", error)
        return Output("", [], finish_reason="error", error=error)

    def event(self, out: Output) -> dict:
        """The record event of an Output it just gave (records.py)."""
        event = {"index": self.index, "text": out.text, "token_ids": out.token_ids,
                 "text_offset": self.num_chars - len(out.text), "token_offset": len(self.token_ids) - len(out.token_ids)}
        if self.prepared.sampling.logprobs is not None and out.logprobs:
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

    def _finish(self, reason: str, why: str) -> None:
        self.finish_reason, self.why = reason, why
        self.metrics.e2e_request_latency.observe(time.monotonic() - self._arrival)
        self.metrics.request_success.labels(finished_reason=reason).inc()
        log.info("request %s finished (%s): %d prompt + %d output tokens in %.3fs", self.request_id, why,
                 self.num_prompt_tokens, len(self.token_ids), time.monotonic() - self._arrival)
