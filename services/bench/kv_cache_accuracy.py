"""`python -m pagedserve.services.bench.kv_cache_accuracy`: what an int8 KV cache costs in accuracy.

Teacher-forced: held-out text (stdlib docstrings, not the model's chat data) cut at --positions
positions, one prefill per KV storage, logits at every position: top-1 agreement with the model's
own dtype, the mean |difference| of that top-1 token's logprob, and how many disagreements fall
on near-ties of the baseline (its top two within NEAR_TIE: a bf16 model's logits cannot order them,
and any change of rounding flips them). Storages: auto (the model's dtype), int8 (the real pool),
and SOURCES, simulated in a wider pool (quantize then restore on write), each read by the baseline's
kernel or in float32: the error sources of int8 one at a time. Then --prompts prompts x --tokens greedy
tokens: where int8 and auto outputs first diverge."""

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


def round_trip(x: torch.Tensor, group: int, exact_scales: bool = False) -> torch.Tensor:
    """x quantized to int8 in groups of `group` along the last dim and restored, in float32: with
    kv_quant's 12-bit scales (max|x| / 127 rounded up), or exact float32 ones."""
    xf = x.float().unflatten(-1, (-1, group))
    scale = xf.abs().amax(-1, keepdim=True) / kv_quant.QMAX
    if not exact_scales:
        shift = 31 - kv_quant.SCALE_BITS
        bits = (scale.view(torch.int32) + (1 << shift) - 1) >> shift
        scale = (bits.clamp_min(16) << shift).view(torch.float32)
    scale = scale.clamp_min(1e-30)
    return (torch.round(xf / scale).clamp(-kv_quant.QMAX, kv_quant.QMAX) * scale).flatten(-2)


class FakeQuantBackend:
    """Wraps a backend: K and V rows go through their round trip (None: stored as they are) into a
    wider pool; attend reads it in float32, or as a copy in the model's dtype: then the kernel is the
    baseline's, and only the rounding of K and V differs from it."""

    def __init__(self, inner, k_trip, v_trip, float32_attention: bool = False):
        self.inner, self.name = inner, inner.name
        self.trips, self.float32_attention = (k_trip, v_trip), float32_attention

    def write_kv(self, key, value, kv_cache, meta):
        k, v = (x if trip is None else trip(x) for trip, x in zip(self.trips, (key, value), strict=True))
        self.inner.write_kv(k, v, kv_cache, meta)

    def attend(self, query, kv_cache, meta, scale, **options):
        if self.float32_attention:
            return self.inner.attend(query.float(), kv_cache, meta, scale, **options).to(query.dtype)
        return self.inner.attend(query, kv_cache.to(query.dtype), meta, scale, **options)


def groups_of(group: int, exact_scales: bool = False):
    return lambda x: round_trip(x, group if x.shape[-1] % group == 0 else x.shape[-1], exact_scales)


PER_ROW = lambda x: round_trip(x, x.shape[-1])  # noqa: E731
# (K round trip, V round trip, float32 attention): each error source of int8 on its own
SOURCES = {"sim-unquantized-float32": (None, None, True),
           "sim-int8-groups": (groups_of(32), groups_of(32), False),
           "sim-int8-groups-float32": (groups_of(32), groups_of(32), True),
           "sim-int8-exact-scales": (groups_of(32, True), groups_of(32, True), False),
           "sim-int8-groups-of-16": (groups_of(16), groups_of(16), False),
           "sim-int8-k-only": (groups_of(32), None, False),
           "sim-int8-v-only": (None, groups_of(32), False),
           "sim-int8-per-row": (PER_ROW, PER_ROW, False)}


def held_out_tokens(model: str, positions: int) -> list[list[int]]:
    """Chunks of positions + 1 tokens, one per module docstring long enough."""
    tok = load_tokenizer(model)
    chunks = []
    for name in HELD_OUT_MODULES:
        ids = tok.encode(pydoc.getdoc(__import__(name)) + "\n" + pydoc.render_doc(name, renderer=pydoc.plaintext))
        if len(ids) > positions:
            chunks.append(ids[: positions + 1])
    return chunks


def float32_logits(worker: Worker, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head in float32: logits unrounded, so bf16's one-step ties do not decide top-1."""
    model = worker.model
    logits = hidden.float() @ model.head.weight.float().T
    cap = model.config.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


def logprobs(worker: Worker, token_ids: list[int], source: tuple | None = None, wide_logits: bool = False):
    """float32 [n, vocab] log-softmax at every position of one prefill (source: a SOURCES entry)."""
    n, bs = len(token_ids), worker.block_size
    meta = AttentionMetadata.build([n], [n], [list(range((n + bs - 1) // bs))], bs)
    caches, backend = worker.pool.kv_caches, worker.backend
    if source is not None:  # a wider pool: the fused rope+write kernel (same dtype only) stands aside
        wide = torch.float64 if worker.dtype == torch.float32 else torch.float32
        caches = [torch.zeros(c.shape, dtype=wide) for c in caches]
        backend = FakeQuantBackend(backend, *source)
    hidden = worker.model(torch.tensor(token_ids), AttentionMetadata.positions(meta), caches, meta, backend)
    logits = float32_logits(worker, hidden) if wide_logits else worker.model.compute_logits(hidden)
    return torch.log_softmax(logits, dim=-1)


def teacher_forced(args) -> dict:
    auto = Worker(EngineConfig(model=args.model, dtype=args.dtype, num_blocks=64))
    int8 = Worker(EngineConfig(model=args.model, dtype=args.dtype, num_blocks=64, kv_cache_dtype="int8"))
    wide = args.float32_logits
    modes = {"int8": lambda ids: logprobs(int8, ids, wide_logits=wide),
             **{m: lambda ids, src=src: logprobs(auto, ids, src, wide) for m, src in SOURCES.items()}}
    agree = {m: 0 for m in modes}
    near_ties = {m: 0 for m in modes}  # disagreements where the baseline's own top two lie within NEAR_TIE
    dlogp = {m: 0.0 for m in modes}
    total = 0
    with torch.inference_mode():
        for ids in held_out_tokens(args.model, args.positions):
            base = logprobs(auto, ids[:-1], wide_logits=wide)
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
    return {"positions": total, "dtype": str(auto.dtype), "float32_logits": wide,
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
    parser.add_argument("--float32-logits", action="store_true",
                        help="every storage's logits from its hidden states by a float32 LM head")
    parser.add_argument("--skip-greedy", action="store_true")
    parser.add_argument("--skip-teacher-forced", action="store_true")
    args = parser.parse_args(argv)
    report = {} if args.skip_teacher_forced else {"teacher_forced": teacher_forced(args)}
    if not args.skip_greedy:
        report["greedy"] = greedy_divergence(args)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
