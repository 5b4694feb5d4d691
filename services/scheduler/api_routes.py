"""Which api process each live request belongs to, and the deltas waiting for each api.

Pure bookkeeping for the scheduler's loop (no Redis). A submission is taken once: a
duplicate of a live or recently finished id is dropped (an api resubmitting to a restarted
scheduler what also still waited in the requests stream). Deltas are grouped per api, so
each api gets one DeltaBatch per step; a finished request is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from services.scheduler.request import Request
from shared.messages import RequestDelta, SubmitRequest

REMEMBER_FINISHED = 10_000  # finished ids kept to drop a late duplicate submission


class ApiRoutes:
    def __init__(self, remember_finished: int = REMEMBER_FINISHED) -> None:
        self._api_of: dict[str, str] = {}  # live request id -> api id
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._remember_finished = remember_finished
        self._outbox: defaultdict[str, list[RequestDelta]] = defaultdict(list)

    def is_known(self, request_id: str) -> bool:
        return request_id in self._api_of or request_id in self._finished

    def add(self, request_id: str, api_id: str) -> None:
        self._api_of[request_id] = api_id

    def api_ids(self) -> list[str]:
        """The apis with live requests."""
        return sorted(set(self._api_of.values()))

    def requests_of(self, api_id: str) -> list[str]:
        return [request_id for request_id, api in self._api_of.items() if api == api_id]

    def route(self, delta: RequestDelta, api_id: str | None = None) -> None:
        """Queue a delta for its request's api (or api_id, for a request never added)."""
        api_id = api_id or self._api_of.get(delta.request_id)
        if delta.finish_reason is not None:
            self._api_of.pop(delta.request_id, None)
            self._finished[delta.request_id] = None
            while len(self._finished) > self._remember_finished:
                self._finished.popitem(last=False)
        if api_id is not None:
            self._outbox[api_id].append(delta)

    def take(self) -> dict[str, list[RequestDelta]]:
        """The queued deltas by api, emptying the queue."""
        outbox, self._outbox = self._outbox, defaultdict(list)
        return dict(outbox)

    def restore(self, outbox: dict[str, list[RequestDelta]]) -> None:
        """Deltas take() gave that could not be sent: ahead of any queued since."""
        for api_id, deltas in outbox.items():
            self._outbox[api_id][:0] = deltas


def request_from_submit(sub: SubmitRequest, eos_token_ids: list[int]) -> Request:
    """A fresh WAITING request; a resubmission resumes after the tokens already delivered."""
    request = Request(sub.request_id, list(sub.prompt_token_ids), sub.sampling, list(eos_token_ids),
                      sub.arrival_time, sub.priority, sub.tenant, sub.cache_salt)
    request.output_token_ids = list(sub.output_token_ids)
    request.num_streamed_tokens = len(sub.output_token_ids)  # the api has them: it sent them back
    return request


def final_delta(request: Request, finish_reason: str, request_id: str | None = None) -> RequestDelta:
    """The finish of a request that never ran here (refused, or done before a restart);
    request_id: one of its n sequences instead (n > 1)."""
    return RequestDelta(request_id or request.request_id, [], finish_reason=finish_reason,
                        num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens)
