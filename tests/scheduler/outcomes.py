"""What a run of scheduler steps produced, read from its StepRecords' deltas."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.scheduler.fakes import StepRecord


def outputs_by_request(records: list[StepRecord]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for record in records:
        for delta in record.deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return outputs


def finish_reasons(records: list[StepRecord]) -> dict[str, str]:
    return {d.request_id: d.finish_reason for r in records for d in r.deltas if d.finish_reason}
