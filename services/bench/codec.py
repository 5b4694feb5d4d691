"""`pagedserve bench codec`: pack + unpack of one step's messages, microseconds per step.

One step of N decodes crosses the wire as five messages, each carrying one entry per
request: AllocRequest (scheduler -> kvstore), AllocReply (back), StepPlan (scheduler ->
worker), StepResult (back) and DeltaBatch (scheduler -> api). Each is packed and unpacked
--repeat times; the median per step is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.shared import codec
from pagedserve.shared import messages as msg


def step_messages(num_requests: int, step_id: int = 1000) -> list:
    """The five messages of a step of num_requests decodes at ~300 tokens of context."""
    ids = [f"cmpl-{i:032x}-0" for i in range(num_requests)]
    return [
        msg.AllocRequest(step_id, [], [msg.AllocCandidate(r, 1, 300 + i, token_ids=[1000 + i], token_ids_start=299 + i)
                                   for i, r in enumerate(ids)]),
        msg.AllocReply(step_id, [msg.AllocResult(r, "ok", [i] if i % 16 == 0 else []) for i, r in enumerate(ids)],
                   num_free_blocks=5000, num_blocks=8000),
        msg.StepPlan(step_id, [], [msg.CachedRequestData(r, [i] if i % 16 == 0 else [], 299 + i, 1)
                               for i, r in enumerate(ids)]),
        msg.StepResult(step_id, [msg.SampledToken(r, 2000 + i) for i, r in enumerate(ids)]),
        msg.DeltaBatch(step_id, [msg.RequestDelta(r, [2000 + i], None, 200, 100 + i, 0) for i, r in enumerate(ids)]),
    ]


def time_step(messages: list, repeat: int) -> dict:
    """Median microseconds to pack, to unpack, and both, over the step's messages."""
    packed = [codec.pack(m) for m in messages]
    for data, message in zip(packed, messages, strict=True):
        assert codec.unpack(data, type(message)) == message
    pack_us, unpack_us = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for m in messages:
            codec.pack(m)
        t1 = time.perf_counter()
        for data, m in zip(packed, messages, strict=True):
            codec.unpack(data, type(m))
        t2 = time.perf_counter()
        pack_us.append((t1 - t0) * 1e6)
        unpack_us.append((t2 - t1) * 1e6)
    return {"pack_us": statistics.median(pack_us), "unpack_us": statistics.median(unpack_us),
            "total_us": statistics.median(p + u for p, u in zip(pack_us, unpack_us, strict=True)),
            "bytes": sum(len(d) for d in packed)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=128, help="decodes in the step (default 128)")
    parser.add_argument("--repeat", type=int, default=2000)


def run(args: argparse.Namespace) -> int:
    result = time_step(step_messages(args.requests), args.repeat)
    print(f"{args.requests} decodes, 5 messages: pack {result['pack_us']:.0f} us + unpack {result['unpack_us']:.0f} us"
          f" = {result['total_us']:.0f} us per step ({result['bytes']} bytes)")
    return 0
