"""Throughput of 64 concurrent requests with a JSON schema on every one vs unconstrained, in the
in-process engine (no api, no Redis: the step's cost alone), and the per-step CPU cost of the masks.
Beside tokens/s it prints the process's CPU time per step (all threads; both need a quiet machine).

Both runs decode 64 sequences x MAX_TOKENS tokens at temperature 1.0 (seeded): the schema asks for
an array of at least 50 records, so no constrained sequence can end before MAX_TOKENS, and the
unconstrained run ignores EOS; the two runs do the same number of steps at the same batch.

    python3 scripts/bench_structured_throughput.py [--dtype auto|float32] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedserve.services.engine import Engine
from pagedserve.services.gpu_worker.sampling import grammar
from pagedserve.shared.messages import GuidedDecoding, SamplingParams

BATCH = 64
RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 50}
FILL_TIMES: list[tuple[float, float]] = []  # (wall, CPU of the mask thread) per step


def _timed_fill(fill):
    def run(*args):
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return fill(*args)
        finally:
            FILL_TIMES.append((time.perf_counter() - started, time.thread_time() - cpu))
    return run


def run(engine: Engine, prompts: list[list[int]], guided: GuidedDecoding | None, max_tokens: int,
        cpu: list[float]) -> float:
    """Output tokens per second; appends the process's CPU seconds per step (all its threads) to cpu."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, guided=guided, ignore_eos=guided is None)
              for i in range(BATCH)]
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    cpu.append((time.process_time() - cpu_started) / max_tokens)
    assert all(len(o.token_ids) == max_tokens for o in outputs), [len(o.token_ids) for o in outputs]
    return BATCH * max_tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    grammar._fill = _timed_fill(grammar._fill)
    engine = Engine(dtype=args.dtype, num_blocks=2048, max_num_seqs=BATCH)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"List people as JSON, batch {i}."}])
               for i in range(BATCH)]
    guided = GuidedDecoding("json", json.dumps(SCHEMA))
    run(engine, prompts, guided, 4, [])  # warm-up at full batch: kernels, the tokenizer, the compiled grammar
    run(engine, prompts, None, 4, [])
    FILL_TIMES.clear()
    names = ("unconstrained", "schema, step thread", "schema, mask thread")
    results: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):  # interleaved, so load on the machine hits all alike
        results["unconstrained"].append(run(engine, prompts, None, args.max_tokens, cpu["unconstrained"]))
        for overlap in (False, True):  # the masks after the forward (a CPU worker's way), or beside it
            engine.worker.grammars.overlap = overlap
            name = f"schema, {'mask' if overlap else 'step'} thread"
            results[name].append(run(engine, prompts, guided, args.max_tokens, cpu[name]))
    for name, values in results.items():
        ratio = max(values) / max(results["unconstrained"])
        cpu_ratio = min(cpu[name]) / min(cpu["unconstrained"])
        print(f"{name:20s} output tokens/s: best {max(values):.1f} ({ratio:.3f} of unconstrained)  "
              f"all {[round(v, 1) for v in values]};  process CPU per step: least {min(cpu[name]) * 1e3:.1f} ms "
              f"({cpu_ratio:.3f} of unconstrained)")
    for k, what in enumerate(("wall", "CPU of the filling thread")):  # both placements together
        fills = sorted(f[k] for f in FILL_TIMES)
        print(f"mask fill per step, {what} (batch {BATCH}, both placements): median "
              f"{statistics.median(fills) * 1e3:.2f} ms  mean {statistics.mean(fills) * 1e3:.2f} ms  "
              f"p90 {fills[int(0.9 * len(fills))] * 1e3:.2f} ms over {len(fills)} steps")


if __name__ == "__main__":
    main()
