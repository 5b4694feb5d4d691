"""Which api each live request belongs to, and the deltas queued per api (no Redis).
A duplicate submission of a live or recently finished id is dropped.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from pagedserve.services.scheduler.request import Request
from pagedserve.shared.messages import RequestDelta, SubmitRequest

REMEMBER_FINISHED = 10_000


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
        outbox, self._outbox = self._outbox, defaultdict(list)
        return dict(outbox)

    def restore(self, outbox: dict[str, list[RequestDelta]]) -> None:
        """Unsent deltas from take(): ahead of any queued since."""
        for api_id, deltas in outbox.items():
            self._outbox[api_id][:0] = deltas


def request_from_submit(sub: SubmitRequest, eos_token_ids: list[int]) -> Request:
    """A fresh WAITING request; a resubmission resumes after the tokens already delivered."""
    request = Request(sub.request_id, list(sub.prompt_token_ids), sub.sampling, list(eos_token_ids),
                      sub.arrival_time, sub.priority, sub.tenant, sub.cache_salt)
    request.output_token_ids = list(sub.output_token_ids)
    request.num_streamed_tokens = len(sub.output_token_ids)
    return request


def final_delta(request: Request, finish_reason: str, request_id: str | None = None) -> RequestDelta:
    """The finish of a request that never ran here; request_id: one of its n sequences."""
    return RequestDelta(request_id or request.request_id, [], finish_reason=finish_reason,
                        num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens)
