"""`pagedserve bench sampler`: the sampler's cost per step at N rows of a vocabulary: greedy argmax
against temperature 1.0 (unseeded, seeded, with top-k/top-p/min-p), through the C++ kernel and
through the torch ops (where it is not built; the arithmetic of the sampler before it). Wall and
CPU (all threads) ms per step, the minimum over rounds, interleaved so outside load hits all alike:
on a shared machine the CPU time is the steadier figure."""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.services.gpu_worker.sampling import race
from pagedserve.services.gpu_worker.sampling.sampler import greedy_tokens, sample
from pagedserve.shared.messages import SamplingParams

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 1.0, seeded": dict(temperature=1.0, seed=7),
    "top-k 50, top-p 0.9, min-p 0.05": dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--torch", action="store_true", help="also time the torch path (no kernel)")


def _step(logits: torch.Tensor, params: list[SamplingParams]):
    n = len(params)
    histories = [[1] * (300 + i) for i in range(n)]  # positions differ per row, as in a batch
    if params[0].temperature <= 0.0:
        return lambda: greedy_tokens(logits)
    return lambda: sample(logits, params, [str(i) for i in range(n)], histories, [256] * n)


def timed(fns: list, repeat: int) -> list[tuple[float, float]]:
    """(wall, CPU) ms of each fn, each the minimum over `repeat` rounds after a warm-up."""
    for fn in fns:
        fn()
    best = [(float("inf"), float("inf")) for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3
            best[i] = (min(best[i][0], wall), min(best[i][1], cpu))
    return best


def run(args: argparse.Namespace) -> int:
    print(f"sampler, vocab {args.vocab}, {torch.get_num_threads()} threads: ms per step, wall and CPU")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 3
        names, fns = [], []
        for name, settings in CASES.items():
            params = [SamplingParams(**settings) for _ in range(rows)]
            names.append(name)
            fns.append(_step(logits, params))
            if args.torch and settings["temperature"] > 0:
                keys = [i * 7919 for i in range(rows)]
                names.append(f"{name} (torch ops)")
                fns.append(lambda x=logits, p=params, k=keys: race.torch_race(x, p, k).tolist())
        for name, (wall, cpu) in zip(names, timed(fns, args.repeat), strict=True):
            print(f"  {rows:4d} rows  {name:<44} {wall:8.1f} {cpu:8.1f}")
    return 0
