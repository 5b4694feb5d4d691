"""One request's life in this api: submit it, turn its deltas into safe text, end it.

A Generation yields Outputs (one per delta batch that concerns it): new text (never a
split character, never any part of a stop string), the new token ids and logprobs, and at
the end a finish reason and usage. When a stop string matches, the request is aborted at
the scheduler and ends here with finish_reason "stop". Whoever drives a Generation must
`close()` it (try/finally): a request that is not finished by then is aborted, so a client
that goes away never leaves blocks behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from services.api.admission import check_limits
from services.api.detokenizer import Detokenizer
from services.api.inputs import Prepared
from services.api.loop import ApiLoop, RedisUnavailable
from services.api.metrics import ApiMetrics
from services.api.protocol import ApiError
from shared.messages import RequestDelta, SampledToken, SubmitRequest

log = logging.getLogger("pagedserve.api")


@dataclass
class Output:
    text: str
    token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None


def unavailable(error: Exception) -> ApiError:
    return ApiError(503, f"the server cannot take requests right now: {error}", code="unavailable",
                    type="service_unavailable")


class Generation:
    def __init__(self, loop: ApiLoop, tokenizer, prepared: Prepared, metrics: ApiMetrics, request_id: str):
        self.loop = loop
        self.tokenizer = tokenizer
        self.prepared = prepared
        self.metrics = metrics
        self.request_id = request_id
        self.created = int(time.time())
        self._text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[SampledToken] = []
        self.finish_reason: str | None = None
        self.why: str | None = None  # what ended it, for logs and callers ("client disconnected", ...)
        self.num_prompt_tokens = len(prepared.prompt_token_ids)
        self.num_cached_tokens = 0
        self._detok = Detokenizer(tokenizer, prepared.prompt_token_ids, prepared.stop)
        self._queue: asyncio.Queue | None = None
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

    async def start(self) -> None:
        """Submit; nothing is submitted when it raises: ApiError(400) past a per-request
        limit, ApiError(429) when the waiting queue is closed to this tenant, ApiError(503)
        when Redis cannot take it."""
        self.check_admission()
        try:
            self.attach(await self.loop.submit(self.submit_message()))
        except RedisUnavailable as e:
            raise unavailable(e) from None

    def check_admission(self) -> None:
        """ApiError(400) past a per-request limit, ApiError(429) when the waiting queue is
        closed to this tenant."""
        p = self.prepared
        admission = self.loop.admission
        check_limits(admission.limits, len(p.prompt_token_ids), p.sampling.max_tokens,
                     "messages" if p.kind == "chat" else "prompt")
        admission.check(p.tenant)

    def submit_message(self) -> SubmitRequest:
        p = self.prepared
        return SubmitRequest(request_id=self.request_id, api_id=self.loop.api_id,
                             prompt_token_ids=p.prompt_token_ids, sampling=p.sampling, arrival_time=time.time(),
                             priority=p.priority, tenant=p.tenant, cache_salt=p.cache_salt)

    def attach(self, queue: asyncio.Queue) -> None:
        """The queue its deltas arrive on: it is submitted now."""
        self._queue = queue
        p = self.prepared
        log.info("request %s submitted: %d prompt tokens, max_tokens %d", self.request_id,
                 len(p.prompt_token_ids), p.sampling.max_tokens)

    async def next(self, timeout: float | None = None) -> Output | None:
        """The next output, or None once finished; TimeoutError if none came in `timeout`."""
        if self.finished or self._queue is None:
            return None
        if not self._queue.empty():  # the common case while streaming: no task, no timer
            delta = self._queue.get_nowait()
        elif timeout is None:
            delta = await self._queue.get()
        else:
            delta = await asyncio.wait_for(self._queue.get(), timeout)
        if delta is None or self.finished:  # woken by abort()
            return None
        return self._apply(delta)

    def abort(self, reason: str = "abort") -> None:
        """End the request now (client gone, DELETE): abort at the scheduler, finish 'abort'."""
        if self.finished:
            return
        if self._queue is not None:
            self.loop.abort(self.request_id, reason)
            self._queue.put_nowait(None)  # wake a reader blocked in next()
        self._finish("abort", reason)

    def close(self, reason: str = "client went away") -> None:
        self.abort(reason)

    def _apply(self, delta: RequestDelta) -> Output:
        now = time.monotonic()
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        ids = list(delta.new_token_ids)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            log.error("request %s: token id out of range in a delta; ending it", self.request_id)
            self.abort("bad token id on the wire")
            return Output("", [], finish_reason="abort")
        finish = delta.finish_reason
        step = self._detok.add(ids, finished=finish is not None)
        if step.stopped:
            if finish is None:
                self.loop.abort(self.request_id, "stop string")
            finish = "stop"
        self.token_ids.extend(ids)
        self.logprobs.extend(delta.logprobs)
        if step.text:
            self._text_parts.append(step.text)
        if ids:
            if self._last_token_time is None:
                self.first_token_time = now
                self.metrics.time_to_first_token.observe(now - self._arrival)
            else:
                self.metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        if finish is not None:
            self._finish(finish, "stop string" if step.stopped else finish)
        return Output(step.text, ids, list(delta.logprobs), finish)

    def _finish(self, reason: str, why: str) -> None:
        self.finish_reason, self.why = reason, why
        self.metrics.e2e_request_latency.observe(time.monotonic() - self._arrival)
        self.metrics.request_success.labels(finished_reason=reason).inc()
        log.info("request %s finished (%s): %d prompt + %d output tokens in %.3fs", self.request_id, why,
                 self.num_prompt_tokens, len(self.token_ids), time.monotonic() - self._arrival)
