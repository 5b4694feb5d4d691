"""The requests live in one api process (no Redis; loop.py moves its messages): each running
sequence's Generation, each request while a sequence of it runs, and the sequences that ended
here, so their late deltas are dropped rather than adopted. It turns a DeltaBatch into outputs
and the aborts the scheduler must be sent, and replays an adopted request's record events."""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.services.api.generation import Generation, Output
from pagedserve.services.api.request import ApiRequest
from pagedserve.shared.messages import DeltaBatch

REMEMBER_ENDED = 10_000  # sequences ended here, so their late deltas are dropped, not adopted


def record_id_of(sequence_id: str) -> str:
    """Sequence i of n > 1 is f"{request_id}.{i}" (request.py); its record is the request's."""
    return sequence_id.rpartition(".")[0] if "." in sequence_id else sequence_id


class LiveTable:
    def __init__(self, remember_ended: int = REMEMBER_ENDED) -> None:
        self.remember_ended = remember_ended
        self._live: dict[str, Generation] = {}  # sequence id -> its Generation, until it finishes
        self._requests: dict[str, ApiRequest] = {}  # request id -> the request, while a sequence is live
        self._ended: OrderedDict[str, None] = OrderedDict()

    def add(self, request: ApiRequest) -> None:
        for gen in request.gens:
            self._live[gen.sequence_id] = gen
        self._requests[request.request_id] = request

    def discard(self, request: ApiRequest) -> None:
        """A request whose submission failed: as if never added."""
        for gen in request.gens:
            self._live.pop(gen.sequence_id, None)
        self._requests.pop(request.request_id, None)

    def request(self, request_id: str) -> ApiRequest | None:
        return self._requests.get(request_id)

    def requests(self) -> list[ApiRequest]:
        return list(self._requests.values())

    def sequences(self) -> list[Generation]:
        return list(self._live.values())

    def is_live(self, sequence_id: str) -> bool:
        return sequence_id in self._live

    def knows(self, sequence_id: str) -> bool:
        """Live or ended here: its deltas need no adoption."""
        return sequence_id in self._live or sequence_id in self._ended

    def retire(self, gen: Generation) -> None:
        self._live.pop(gen.sequence_id, None)
        self._end(gen.sequence_id)
        if all(g.finished for g in gen.request.gens):
            self._requests.pop(gen.request.request_id, None)

    def unknown(self, batch: DeltaBatch) -> list[str]:
        """The batch's sequences neither live nor ended here (submitted by an earlier run): to adopt."""
        return list(dict.fromkeys(d.request_id for d in batch.deltas if not self.knows(d.request_id)))

    def forget(self, sequence_id: str) -> None:
        """A sequence with no record: its deltas are dropped from now on."""
        self._end(sequence_id)

    def adopt(self, request: ApiRequest, events: list[tuple[int, dict]]) -> None:
        """A request rebuilt from its record: its (seq, event)s replayed, its open sequences live."""
        for seq, event in events:
            gen = request.gens[event["index"]]
            if event.get("finish_reason") is not None:
                gen.finish_reason = event["finish_reason"]
            elif not gen.finished:
                gen.replay(event["token_ids"])
            request.seq = seq
        for gen in request.gens:
            if gen.finished:
                self._end(gen.sequence_id)
            else:
                self._live[gen.sequence_id] = gen
        if not all(gen.finished for gen in request.gens):
            self._requests[request.request_id] = request

    def apply(self, batch: DeltaBatch) -> tuple[list[tuple[Generation, Output]], list[tuple[str, str]]]:
        """(each live sequence's Output, the (sequence id, why) to abort at the scheduler: a stop
        string or a delta it cannot take ended it here first). Unknown sequences are skipped."""
        items, aborts = [], []
        for delta in batch.deltas:
            gen = self._live.get(delta.request_id)
            if gen is None:
                continue
            out = gen.apply(delta)
            if gen.abort_why is not None:
                aborts.append((gen.sequence_id, gen.abort_why))
                gen.abort_why = None
            if out is None:
                continue
            if out.finish_reason is not None:
                self.retire(gen)
            items.append((gen, out))
        return items, aborts

    def _end(self, sequence_id: str) -> None:
        self._ended[sequence_id] = None
        while len(self._ended) > self.remember_ended:
            self._ended.popitem(last=False)
