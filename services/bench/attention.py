"""`pagedserve bench attention`: the price of paging on the CPU, one layer of TorchPagedBackend.attend
on permuted blocks against dense SDPA, decodes, a prefill and both mixed; min / median of rounds."""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.attention import torch_paged
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
GROUP = NUM_HEADS // NUM_KV_HEADS


def timed(fns: list, repeat: int) -> list[tuple[float, float]]:
    """(min, median) ms of each fn after two warm-ups, interleaved so outside load hits all alike."""
    for fn in fns:
        fn()
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, own in zip(fns, samples, strict=True):
            t0 = time.perf_counter()
            fn()
            own.append((time.perf_counter() - t0) * 1e3)
    return [(min(own), statistics.median(own)) for own in samples]


def make_step(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, rng: random.Random):
    """A pool holding every request's context in randomly permuted blocks, and the step's q/k/v."""
    need = [(s + BLOCK_SIZE - 1) // BLOCK_SIZE for s in seq_lens]
    ids = list(range(sum(need) + 8))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    cache = torch.randn(2, len(ids), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    t = sum(query_lens)
    q = torch.randn(t, NUM_HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(t, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    return meta, cache, q, k, v


def _rand(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def dense_decode_padded(seq_lens: list[int], dtype: torch.dtype):
    """Contiguous padded cache [B, Hkv, L, D]; GQA as query rows, like the paged path."""
    b, length = len(seq_lens), max(seq_lens)
    q = _rand(b, NUM_KV_HEADS, GROUP, HEAD_DIM, dtype=dtype)
    k, v = (_rand(b, NUM_KV_HEADS, length, HEAD_DIM, dtype=dtype) for _ in range(2))
    mask = (torch.arange(length)[None, :] < torch.tensor(seq_lens)[:, None])[:, None, None, :]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def dense_decode_exact(seq_lens: list[int], dtype: torch.dtype):
    """One SDPA per request on contiguous K/V of exactly its length."""
    parts = [(_rand(NUM_KV_HEADS, GROUP, HEAD_DIM, dtype=dtype), _rand(NUM_KV_HEADS, s, HEAD_DIM, dtype=dtype),
              _rand(NUM_KV_HEADS, s, HEAD_DIM, dtype=dtype)) for s in seq_lens]
    return lambda: [F.scaled_dot_product_attention(q, k, v) for q, k, v in parts]


def dense_prefill(q_len: int, seq_len: int, dtype: torch.dtype):
    """Contiguous [1, H, L, D] tensors, K/V already expanded to all query heads."""
    q = _rand(1, NUM_HEADS, q_len, HEAD_DIM, dtype=dtype)
    k, v = (_rand(1, NUM_HEADS, seq_len, HEAD_DIM, dtype=dtype) for _ in range(2))
    if q_len == seq_len:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def run_case(query_lens, seq_lens, dtype, rng, repeat) -> dict[str, tuple[float, float]]:
    meta, cache, q, k, v = make_step(query_lens, seq_lens, dtype, rng)
    scale = HEAD_DIM**-0.5
    backend = TorchPagedBackend()  # the C++ decode kernel where it loads (float32)
    sdpa_backend = TorchPagedBackend(use_kernel=False)
    decodes = [s for ql, s in zip(query_lens, seq_lens, strict=True) if ql == 1]
    prefills = [dense_prefill(ql, s, dtype) for ql, s in zip(query_lens, seq_lens, strict=True) if ql > 1]
    variants = {"paged": lambda: backend.attend(q, cache, meta, scale),
                "paged sdpa": lambda: sdpa_backend.attend(q, cache, meta, scale)}
    dense_kinds = {"dense padded": dense_decode_padded, "dense exact": dense_decode_exact}
    for name, make in dense_kinds.items():
        parts = ([make(decodes, dtype)] if decodes else []) + prefills
        variants[name] = lambda parts=parts: [part() for part in parts]
    if decodes:
        one_bucket = TorchPagedBackend(use_kernel=False)
        saved, torch_paged.PAD_TOKENS_PER_CALL = torch_paged.PAD_TOKENS_PER_CALL, 1 << 30
        one_bucket._plan = torch_paged._build_plan(meta, BLOCK_SIZE)  # reused: same meta object
        torch_paged.PAD_TOKENS_PER_CALL = saved
        variants["paged 1 bucket"] = lambda: one_bucket.attend(q, cache, meta, scale)
    variants["write_kv"] = lambda: backend.write_kv(k, v, cache, meta)
    variants["plan"] = lambda: torch_paged._build_plan(meta, BLOCK_SIZE)
    return dict(zip(variants, timed(list(variants.values()), repeat), strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedserve bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    torch.manual_seed(0)
    decode_lens = [rng.randint(64, 800) for _ in range(64)]
    cases = [
        ("decode 64 x ctx 64..800", [1] * 64, decode_lens),
        ("prefill 512, no context", [512], [512]),
        ("prefill 512 after 512 cached", [512], [1024]),
        ("mixed: 64 decodes + prefill 512", [1] * 64 + [512], decode_lens + [512]),
    ]
    columns = ["paged", "paged sdpa", "dense padded", "dense exact", "paged 1 bucket", "write_kv", "plan"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; heads {NUM_HEADS}/{NUM_KV_HEADS}, "
          f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; ms per layer call, min / median of {args.repeat}")
    print(f"{'case':32s} {'dtype':8s}" + "".join(f"{c:>16s}" for c in columns))
    for dtype in (torch.float32, torch.bfloat16):
        for name, q_lens, s_lens in cases:
            got = run_case(q_lens, s_lens, dtype, rng, args.repeat)
            cells = [f"{got[c][0]:7.2f} /{got[c][1]:7.2f}" if c in got else f"{'-':>16s}" for c in columns]
            print(f"{name:32s} {str(dtype)[6:]:8s}" + "".join(f"{c:>16s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
