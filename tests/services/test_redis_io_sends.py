"""redis_io.read_group(sends=...): a step's messages go out in order, then the read, in one round trip."""

import asyncio
import uuid

import pytest

from pagedserve.shared import redis_io
from pagedserve.shared.codec import unpack
from pagedserve.shared.messages import AllocReply, StepResult
from pagedserve.shared.redis_connect import async_client
from pagedserve.shared.streams import FIELD
from tests.services.conftest import REDIS_URL, delete_prefix


async def _exchange(prefix: str, group_first: bool) -> tuple[list, list]:
    r = async_client(REDIS_URL)
    inbox, outbox = f"{prefix}:inbox", f"{prefix}:outbox"
    try:
        if group_first:
            await redis_io.ensure_group(r, inbox, "g")
        sends = [(outbox, StepResult(1, [])), (inbox, AllocReply(7, worker_id="w")), (outbox, StepResult(2, []))]
        entries = await redis_io.read_group(r, "g", "c", {inbox: (AllocReply,)}, 50, sends=sends)
        sent = [unpack(fields[FIELD]).step_id for _id, fields in await r.xrange(outbox)]
        return [(e.message.step_id, e.message.worker_id) for e in entries], sent
    finally:
        await r.aclose()


@pytest.mark.parametrize("group_first", [True, False])
def test_sends_go_out_in_order_before_the_read(group_first):
    prefix = f"test-sends-{uuid.uuid4().hex[:8]}"
    try:
        read, sent = asyncio.run(_exchange(prefix, group_first))
    finally:
        delete_prefix(prefix)
    assert sent == [1, 2]
    # sent to the stream read, before the read: read back in the same trip (no group yet: it is made, none read)
    assert read == ([(7, "w")] if group_first else [])


async def _refused_send(prefix: str) -> list:
    r = async_client(REDIS_URL)
    inbox, not_a_stream = f"{prefix}:inbox", f"{prefix}:string"
    try:
        await redis_io.ensure_group(r, inbox, "g")
        await r.set(not_a_stream, "x")  # XADD to it: WRONGTYPE
        sends = [(not_a_stream, StepResult(1, [])), (inbox, AllocReply(7, worker_id="w"))]
        with pytest.raises(redis_io.SendFailed) as failed:
            await redis_io.read_group(r, "g", "c", {inbox: (AllocReply,)}, 50, sends=sends)
        return [(e.message.step_id, e.message.worker_id) for e in failed.value.entries]
    finally:
        await r.aclose()


def test_a_refused_send_keeps_what_the_read_took():
    prefix = f"test-sends-{uuid.uuid4().hex[:8]}"
    try:
        assert asyncio.run(_refused_send(prefix)) == [(7, "w")]  # acked by the read: handed over, not lost
    finally:
        delete_prefix(prefix)
