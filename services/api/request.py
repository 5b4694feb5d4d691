"""The api's one request record: what the client asked (validated once, by inputs.prepare), its
id, and its n sequences (one Generation each), from submission to the last record event.

Sequence i of n > 1 is f"{request_id}.{i}" and ends on its own. Whoever drives a request runs
it under edge.while_connected, which aborts every sequence still open when it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pagedserve.services.api.generation import Generation, Output
from pagedserve.services.api.tool_calls import ToolUse
from pagedserve.shared.messages import SamplingParams, SubmitRequest
from pagedserve.shared.parallel_sampling import child_request_ids

if TYPE_CHECKING:
    from pagedserve.services.api.echo import PromptEcho


@dataclass(eq=False)
class ApiRequest:
    kind: str  # "completion" or "chat"
    model: str  # the served name responses report
    request_id: str  # "cmpl-..." or "chatcmpl-..."; the record's key
    prompt_token_ids: list[int]
    sampling: SamplingParams  # the request's (n); sequence i samples with child_sampling(sampling, i)
    stop: list[str]  # non-empty stop strings
    priority: int = 0
    tenant: str | None = None
    cache_salt: str = ""  # "" (none) shares prefix-cache blocks only with other unsalted requests
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    tool_use: ToolUse | None = None  # chat with tools: how its output is read (tool_calls.py)
    prompt: PromptEcho | None = None  # echo, prompt logprobs (echo.py)
    created: int = field(default_factory=lambda: int(time.time()))
    gens: list[Generation] = field(default_factory=list)  # its sequences, by index, once opened
    seq: int = 0  # the last record event written
    end: Callable[[Generation, str, str], None] | None = None  # (sequence, finish, why): its api loop's end

    @classmethod
    def adopted(cls, request_id: str, meta: dict, submit: SubmitRequest) -> ApiRequest:
        """A request an earlier run of this api submitted, rebuilt from its record (not opened yet)."""
        use = meta.get("tool_use")
        return cls(kind=meta["kind"], model=meta["model"], request_id=request_id,
                   prompt_token_ids=list(submit.prompt_token_ids), sampling=submit.sampling,
                   stop=list(meta["stop"]), priority=submit.priority, tenant=submit.tenant,
                   cache_salt=submit.cache_salt, created=meta["created"],
                   tool_use=None if use is None else ToolUse(use["mode"], parallel=use["parallel"]))

    def open(self, api_id: str, tokenizer, metrics, end: Callable[[Generation, str, str], None],
             listen: bool = True) -> ApiRequest:
        """Its sequences; listen False: nobody streams it from here (REST), its record is all there is."""
        ids = child_request_ids(self.request_id, self.sampling.n)
        self.gens = [Generation(self, index, sequence_id, api_id, tokenizer, metrics, listen)
                     for index, sequence_id in enumerate(ids)]
        self.end = end
        return self

    def meta(self, api_id: str) -> dict:
        """The record's description of it (records.py); with the submission, enough to adopt it."""
        meta = {"kind": self.kind, "model": self.model, "created": self.created, "n": len(self.gens),
                "stop": self.stop, "logprobs": self.sampling.logprobs, "api_id": api_id, "tenant": self.tenant}
        if self.tool_use is not None:  # how its readers parse its calls (records.py)
            meta["tool_use"] = {"mode": self.tool_use.mode, "parallel": self.tool_use.parallel}
        return meta

    def group_submit(self) -> SubmitRequest:
        """The one submission of all its sequences (the scheduler forks n > 1)."""
        return replace(self.gens[0].submit_message(), request_id=self.request_id, sampling=self.sampling)

    @property
    def why(self) -> str | None:
        """What ended it: the first sequence's reason (all end together when a client leaves)."""
        return self.gens[0].why

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """(index, output) of every sequence until all finish."""
        if len(self.gens) == 1:  # one layer less per token
            gen = self.gens[0]
            while (out := await gen.next()) is not None:
                yield 0, out
            return
        async for item in merge([_indexed(i, gen) for i, gen in enumerate(self.gens)]):
            yield item

    def close(self, reason: str) -> None:
        """Abort every sequence not finished yet (at the scheduler; each records finish "abort")."""
        for gen in self.gens:
            if not gen.finished:
                self.end(gen, "abort", reason)

    def usage(self) -> dict:
        """The prompt once, the completions of every sequence."""
        first = self.gens[0].usage()
        completion = 0 if self.prompt and self.prompt.drop_output else sum(len(gen.token_ids) for gen in self.gens)
        usage = {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
                 "total_tokens": first["prompt_tokens"] + completion}
        usage["prompt_tokens_details"] = {"cached_tokens": max(gen.num_cached_tokens for gen in self.gens)}
        return usage


async def _indexed(index: int, gen: Generation) -> AsyncIterator[tuple[int, Output]]:
    while (out := await gen.next()) is not None:
        yield index, out


async def merge(sources: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as they come, until all end (each drained by its own task)."""
    merged: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(source: AsyncIterator) -> None:
        try:
            async for item in source:
                await merged.put(item)
        finally:
            await merged.put(done)

    tasks = [asyncio.create_task(pump(source)) for source in sources]
    try:
        num_running = len(tasks)
        while num_running:
            item = await merged.get()
            if item is done:
                num_running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
