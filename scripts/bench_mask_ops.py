"""What a schema on every row adds to one batch-64 step, op by op, in CPU time: everything runs on
the calling thread (torch and xgrammar on one thread), each op is timed with time.thread_time() and
the minimum of several repeats at each step is kept. Other processes on the machine take wall time,
not this thread's CPU time, so the figures hold still on a loaded machine (within the slowdown
shared caches give), where wall-clock means and medians swing tenfold.

64 matchers on one nested JSON schema (bench_grammar_masks.py's), each replaying a different valid
document, so rows sit in different states; SmolLM2's 49152-token vocabulary; random logits. Per step:
- fill: the 64 mask rows, one matcher call per row, or xgrammar's batch call (what the worker does);
- apply: the masks to the logits: xgrammar's CPU apply, or the kernel's word-level mask_rows;
- sample at temperature 1.0: the kernel's race unconstrained, and with the masks fused in.
Added per step = batch fill + masked race - unconstrained race (what the worker pays for the masks).

    python3 scripts/bench_mask_ops.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_grammar_masks import BATCH, EOS, SCHEMA, VOCAB, documents  # noqa: E402

from pagedserve.services.gpu_worker.kernels import cpu_extensions  # noqa: E402
from pagedserve.services.gpu_worker.sampling import grammar  # noqa: E402
from pagedserve.services.gpu_worker.sampling.race import row_settings, signed_keys  # noqa: E402
from pagedserve.shared.messages import SamplingParams  # noqa: E402
from pagedserve.shared.tokenizer import load_tokenizer  # noqa: E402


def least(op, repeats: int) -> float:
    """The least CPU time of this thread over repeats of op."""
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        op()
        best = min(best, time.thread_time() - started)
    return best


def step_costs(matchers, live: list[int], bitmask, logits, settings, keys, kernel, repeats: int) -> dict[str, float]:
    """Each op's least CPU time at this step (the matchers' states); live: the rows still constrained."""
    import xgrammar as xgr

    flags = torch.zeros(len(matchers), dtype=torch.bool)
    flags[live] = True
    masked = logits.clone()  # applying a mask twice changes nothing: the repeats see the same work

    def per_row():
        for i in live:
            matchers[i].fill_next_token_bitmask(bitmask, i)

    return {
        "fill, a call per row": least(per_row, repeats),
        "fill, batch call": least(lambda: grammar._batch_matcher().batch_fill_next_token_bitmask(
            [matchers[i] for i in live], bitmask, live), repeats),
        "apply, xgrammar": least(lambda: xgr.apply_token_bitmask_inplace(masked, bitmask, indices=live), repeats),
        "apply, mask_rows": least(lambda: kernel.mask_rows(masked, bitmask, torch.tensor(live)), repeats),
        "race, unconstrained": least(lambda: kernel.sample_rows(logits, *settings, keys), repeats),
        "race, masks fused": least(lambda: kernel.sample_masked_rows(logits, *settings, keys, bitmask, flags),
                                   repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # every op on this thread: its CPU time is the op's whole cost
    import xgrammar as xgr

    kernel = cpu_extensions.load("sample")
    assert kernel is not None, "the C++ sampling kernel could not be built"
    tokenizer = load_tokenizer("smollm2")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    cold = least(lambda: xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False), 1)
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    cached = least(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False), args.repeats)
    sequences = [tokenizer.encode(d, add_special_tokens=False) + [EOS] for d in documents(BATCH)]
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask = xgr.allocate_token_bitmask(BATCH, VOCAB)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(BATCH)]
    settings = row_settings(params)
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    ops: dict[str, list[float]] = {name: [] for name in (
        "fill, a call per row", "fill, batch call", "apply, xgrammar", "apply, mask_rows",
        "race, unconstrained", "race, masks fused")}
    for step in range(max(map(len, sequences)) - 1):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        keys = signed_keys([(step << 20) + i for i in range(BATCH)])
        for name, seconds in step_costs(matchers, live, bitmask, logits, settings, keys, kernel,
                                        args.repeats).items():
            ops[name].append(seconds)
        for i, seq in enumerate(sequences):
            if step < len(seq) and not matchers[i].is_terminated():
                assert matchers[i].accept_token(seq[step])
    print(f"compile (CPU): cold {cold * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms")
    print(f"CPU per batch-{BATCH} step, one thread, the least of {args.repeats} repeats at each of "
          f"{len(ops['race, unconstrained'])} steps:")
    for name, values in ops.items():
        print(f"  {name:22s} mean {statistics.mean(values) * 1e3:7.3f} ms  median "
              f"{statistics.median(values) * 1e3:7.3f} ms  max {max(values) * 1e3:7.3f} ms")
    added = [f + m - u for f, m, u in zip(ops["fill, batch call"], ops["race, masks fused"],
                                          ops["race, unconstrained"], strict=True)]
    print(f"  added by the masks     mean {statistics.mean(added) * 1e3:7.3f} ms  (batch fill + fused race "
          f"- unconstrained race)")


if __name__ == "__main__":
    main()
