"""`python -m pagedserve.services.bench.kv_cache_accuracy`: what an int8 KV cache costs in accuracy.

Teacher-forced: held-out text (stdlib docstrings, not the model's chat data) cut at --positions
positions, one prefill per KV storage, logits at every position: top-1 agreement with the model's
own dtype, the mean |difference| of that top-1 token's logprob, and how many disagreements fall
on near-ties of the baseline (its top two within NEAR_TIE: a bf16 model's logits cannot order them,
and any change of rounding flips them). Storages: auto (the model's
dtype), int8 (the real pool), and, simulated in a wider pool (quantize then dequantize on write,
read by the same SDPA path): no quantization (the floor of a different summation order), int8 in
groups of 32 (what the pool stores) and int8 with one scale per row (token and head: coarser,
the format before groups). Then --prompts prompts x --tokens greedy tokens: where
int8 and auto outputs first diverge."""

from __future__ import annotations

import argparse
import json
import pydoc

import torch

from pagedserve.services.engine import Engine
from pagedserve.services.gpu_worker.attention import kv_quant
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.worker import Worker
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams
from pagedserve.shared.tokenizer import load_tokenizer

# a near-tie: the baseline's top two logprobs within two bf16 steps of a logit in [16, 32)
NEAR_TIE = 0.25
HELD_OUT_MODULES = ("textwrap", "difflib", "heapq", "bisect", "fractions", "statistics", "shlex", "string")


class FakeQuantBackend:
    """Wraps a backend: K/V rows are quantized to int8 and back (per_row None: not at all; True: one
    bf16 scale per row; False: kv_quant's groups) before they are stored in a pool wider than the
    model's dtype, which the attention reads in the model's dtype."""

    def __init__(self, inner, per_row: bool | None):
        self.inner, self.per_row, self.name = inner, per_row, inner.name

    def _round_trip(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_row is None:
            return x
        if not self.per_row:
            return kv_quant.dequantize(kv_quant.quantize(x), x.dtype)
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / kv_quant.QMAX).clamp_min(1e-30).to(torch.bfloat16).float()
        return (torch.round(xf / scale).clamp(-kv_quant.QMAX, kv_quant.QMAX) * scale).to(x.dtype)

    def write_kv(self, key, value, kv_cache, meta):
        self.inner.write_kv(self._round_trip(key), self._round_trip(value), kv_cache, meta)

    def attend(self, query, kv_cache, meta, scale):
        return self.inner.attend(query, kv_cache, meta, scale)


def held_out_tokens(model: str, positions: int) -> list[list[int]]:
    """Chunks of positions + 1 tokens, one per module docstring long enough."""
    tok = load_tokenizer(model)
    chunks = []
    for name in HELD_OUT_MODULES:
        ids = tok.encode(pydoc.getdoc(__import__(name)) + "\n" + pydoc.render_doc(name, renderer=pydoc.plaintext))
        if len(ids) > positions:
            chunks.append(ids[: positions + 1])
    return chunks


def logprobs(worker: Worker, token_ids: list[int], per_row: bool | None = False, simulate: bool = False):
    """float32 [n, vocab] log-softmax at every position of one prefill (simulate: FakeQuantBackend)."""
    n, bs = len(token_ids), worker.block_size
    meta = AttentionMetadata.build([n], [n], [list(range((n + bs - 1) // bs))], bs)
    caches, backend = worker.pool.kv_caches, worker.backend
    if simulate:  # a wider pool than the model's dtype: the fused rope+write kernel (same dtype only) stands aside
        wide = torch.float64 if worker.dtype == torch.float32 else torch.float32
        caches = [torch.zeros(c.shape, dtype=wide) for c in caches]
        backend = FakeQuantBackend(backend, per_row)
    hidden = worker.model(torch.tensor(token_ids), AttentionMetadata.positions(meta), caches, meta, backend)
    return torch.log_softmax(worker.model.compute_logits(hidden), dim=-1)


def teacher_forced(args) -> dict:
    auto = Worker(EngineConfig(model=args.model, dtype=args.dtype, num_blocks=64))
    int8 = Worker(EngineConfig(model=args.model, dtype=args.dtype, num_blocks=64, kv_cache_dtype="int8"))
    modes = {"int8": lambda ids: logprobs(int8, ids),
             "sim-unquantized": lambda ids: logprobs(auto, ids, None, simulate=True),
             "sim-int8-groups": lambda ids: logprobs(auto, ids, False, simulate=True),
             "sim-int8-per-row": lambda ids: logprobs(auto, ids, True, simulate=True)}
    agree = {m: 0 for m in modes}
    near_ties = {m: 0 for m in modes}  # disagreements where the baseline's own top two lie within NEAR_TIE
    dlogp = {m: 0.0 for m in modes}
    total = 0
    with torch.inference_mode():
        for ids in held_out_tokens(args.model, args.positions):
            base = logprobs(auto, ids[:-1])
            top = base.argmax(-1)
            two = base.topk(2, dim=-1).values
            near = (two[:, 0] - two[:, 1]) <= NEAR_TIE
            total += len(top)
            for m, run in modes.items():
                lp = run(ids[:-1])
                same = lp.argmax(-1) == top
                agree[m] += int(same.sum())
                near_ties[m] += int((~same & near).sum())
                dlogp[m] += float((lp.gather(1, top[:, None]) - base.gather(1, top[:, None])).abs().sum())
    return {"positions": total, "dtype": str(auto.dtype),
            **{m: {"top1_agreement": agree[m] / total, "mean_abs_dlogprob": dlogp[m] / total,
                   "disagreements": total - agree[m], "of_them_near_ties": near_ties[m]} for m in modes}}


def greedy_divergence(args) -> dict:
    tok = load_tokenizer(args.model)
    prompts = [tok.encode(f"Write a short paragraph about topic number {i}: " + t)
               for i, t in enumerate(["rivers", "cities", "music", "stars", "trees", "bread", "ships", "clocks"] * 4)]
    prompts = prompts[: args.prompts]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for kv in ("auto", "int8"):
        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=kv, kv_cache_memory="256MiB"))
        outs[kv] = [o.token_ids for o in engine.generate(prompts, sampling)]
    first = []
    for a, b in zip(outs["auto"], outs["int8"], strict=True):
        first.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None))
    diverged = sorted(i for i in first if i is not None)
    return {"prompts": len(prompts), "tokens": args.tokens, "identical": first.count(None),
            "first_divergence": diverged,
            "median_first_divergence": diverged[len(diverged) // 2] if diverged else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: bfloat16 where native)")
    parser.add_argument("--positions", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--skip-greedy", action="store_true")
    parser.add_argument("--skip-teacher-forced", action="store_true")
    args = parser.parse_args(argv)
    report = {} if args.skip_teacher_forced else {"teacher_forced": teacher_forced(args)}
    if not args.skip_greedy:
        report["greedy"] = greedy_divergence(args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
