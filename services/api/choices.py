"""The api's request type: n >= 1 choices, one Generation per sequence, one submission, one record.

Sequence i of n > 1 is f"{request_id}.{i}" and ends on its own. Whoever drives Choices
must close() it (try/finally): every sequence not finished by then is aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from pagedserve.services.api.edge import ApiState
from pagedserve.services.api.generation import Generation, Output, unavailable
from pagedserve.services.api.inputs import Prepared
from pagedserve.services.api.loop import RedisUnavailable
from pagedserve.shared.messages import SubmitRequest
from pagedserve.shared.parallel_sampling import child_request_ids, child_sampling

log = logging.getLogger("pagedserve.api")


class Choices:
    def __init__(self, state: ApiState, prepared: Prepared, conn=None, request_id: str | None = None,
                 listen: bool = True) -> None:
        """listen False: nobody streams it from here (REST); its record is all there is."""
        first = state.generation(prepared, conn, request_id)  # names the request, sets the tenant
        self.request_id, self.prepared, self.created = first.request_id, prepared, first.created
        n = prepared.sampling.n
        if n == 1:
            self.gens = [first]
        else:
            self.gens = [Generation(state.loop, state.tokenizer, replace(prepared, sampling=child_sampling(
                prepared.sampling, index)), state.metrics, child_id, self.request_id, index)
                for index, child_id in enumerate(child_request_ids(self.request_id, n))]
        if not listen:
            for gen in self.gens:
                gen.outputs = None
        self.seq = 0  # the last record event written
        self._loop = state.loop

    @classmethod
    def adopted(cls, state: ApiState, request_id: str, meta: dict, submit: SubmitRequest) -> Choices:
        """A request an earlier run of this api submitted, rebuilt from its record (nobody listens)."""
        prepared = Prepared(kind=meta["kind"], model=meta["model"], prompt_token_ids=list(submit.prompt_token_ids),
                            sampling=submit.sampling, stop=list(meta["stop"]), priority=submit.priority,
                            tenant=submit.tenant, cache_salt=submit.cache_salt)
        choices = cls(state, prepared, None, request_id, listen=False)
        choices.created = meta["created"]
        return choices

    def meta(self) -> dict:
        """The record's description of it (records.py); with the submission, enough to adopt it."""
        p = self.prepared
        return {"kind": p.kind, "model": p.model, "created": self.created, "n": len(self.gens), "stop": p.stop,
                "logprobs": p.sampling.logprobs, "api_id": self._loop.api_id, "tenant": p.tenant}

    def group_submit(self) -> SubmitRequest:
        return replace(self.gens[0].submit_message(), request_id=self.request_id, sampling=self.prepared.sampling)

    @property
    def why(self) -> str | None:
        """What ended it: the first sequence's reason (all end together when a client leaves)."""
        return self.gens[0].why

    async def start(self) -> None:
        """Record and submit it once; raising (ApiError 400, 429 or 503) means nothing was submitted."""
        self.gens[0].check_admission()
        try:
            await self._loop.submit(self)
        except RedisUnavailable as e:
            raise unavailable(e) from None
        p = self.prepared
        log.info("request %s submitted: %d prompt tokens, max_tokens %d, n %d", self.request_id,
                 len(p.prompt_token_ids), p.sampling.max_tokens, len(self.gens))

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        """(index, output) of every sequence until all finish; run edge.close_on_disconnect beside it."""
        if len(self.gens) == 1:  # one layer less per token
            gen = self.gens[0]
            while (out := await gen.next()) is not None:
                yield 0, out
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen: Generation) -> None:
            try:
                while (out := await gen.next()) is not None:
                    await merged.put((index, out))
            finally:
                await merged.put((index, None))

        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(self.gens)]
        try:
            num_running = len(tasks)
            while num_running:
                index, out = await merged.get()
                if out is None:
                    num_running -= 1
                else:
                    yield index, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self, reason: str = "client went away") -> None:
        for gen in self.gens:
            gen.close(reason)

    def usage(self) -> dict:
        """The prompt once, the completions of every sequence."""
        first = self.gens[0].usage()
        completion = sum(len(gen.token_ids) for gen in self.gens)
        usage = {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
                 "total_tokens": first["prompt_tokens"] + completion}
        cached = max(gen.num_cached_tokens for gen in self.gens)
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage
