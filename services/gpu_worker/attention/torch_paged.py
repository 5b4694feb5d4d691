"""Paged attention in plain torch (CPU): C++ kernels where they load, else bucketed masked SDPA for decodes
and one causal SDPA per prefill chunk; padded keys are read, so the pool must hold finite values."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.attention.kv_quant import from_cache, is_quantized, to_cache
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata
from pagedserve.services.gpu_worker.attention.windowed import attend_windowed
from pagedserve.services.gpu_worker.kernels import cpu_extensions

# A new decode bucket opens once the next request would add more padded key positions than this.
PAD_TOKENS_PER_CALL = 64
VERIFY_MAX_ROWS = 8


@dataclass
class _DecodeBucket:
    token_idx: torch.Tensor  # int64 [b], flat token index of each decode request's query
    block_ids: torch.Tensor  # int64 [b * num_blocks], block tables row-major, padded with 0
    num_blocks: int  # blocks per request in this bucket (the longest one's count)
    mask: torch.Tensor  # bool [b, 1, 1, num_blocks * block_size], True = key is in context


@dataclass
class _KernelDecodes:
    token_idx: torch.Tensor  # int64 [R]: decodes, and each token of queries up to VERIFY_MAX_ROWS long
    block_tables: torch.Tensor  # int32 [R, max_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [R]: such a query's row r sees s - q + r + 1 positions (causal)


@dataclass
class _KernelPrefills:
    block_tables: torch.Tensor  # int32 [P, max_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [P]
    q_lens: torch.Tensor  # int32 [P]
    q_starts: torch.Tensor  # int64 [P], flat index of each chunk's first query token


@dataclass
class _Prefill:
    start: int  # flat token range [start, start + q_len)
    q_len: int
    seq_len: int
    block_ids: torch.Tensor  # int64 [num_blocks] covering seq_len positions
    mask: torch.Tensor | None  # bool [q_len, seq_len] causal with offset; None = no context


@dataclass
class _Plan:
    meta: AttentionMetadata  # held so that its id cannot be reused by a later step's metadata
    block_size: int
    use_kernel: bool
    decodes: list[_DecodeBucket]
    kernel_decodes: _KernelDecodes | None  # set when the C++ kernel is loaded; then decodes is empty
    use_prefill_kernel: bool
    kernel_prefills: _KernelPrefills | None  # set for the C++ prefill kernel; then prefills is empty
    prefills: list[_Prefill]
    workspace_rows: int  # most blocks any single gather needs
    rows_alone: bool = False  # a lone query: each row split over threads as a lone decode of it


def _blocks_for(seq_len: int, block_size: int) -> int:
    return (seq_len + block_size - 1) // block_size


def _bucket_decodes(requests: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Sort decode requests by context length; cut where padding gets dearer than a call."""
    order = sorted(requests, key=lambda i: seq_lens[i])
    buckets: list[list[int]] = []
    current: list[int] = []
    width = 0  # padded key length of the current bucket
    for i in order:
        need = _blocks_for(seq_lens[i], block_size) * block_size
        if current and (need - width) * len(current) > PAD_TOKENS_PER_CALL:
            buckets.append(current)
            current = []
        current.append(i)
        width = need
    if current:
        buckets.append(current)
    return buckets


def _build_plan(meta: AttentionMetadata, block_size: int, use_kernel: bool = False,
                use_prefill_kernel: bool = False) -> _Plan:
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    tables = meta.block_tables.to("cpu", torch.int64)
    device = meta.block_tables.device
    decodes, prefills, rows = [], [], 1
    decode_reqs = [i for i, q in enumerate(q_lens) if q == 1]
    kernel_decodes = None
    row_reqs = [i for i, q in enumerate(q_lens) if q <= VERIFY_MAX_ROWS] if use_kernel else []
    if row_reqs:
        row_of = [(i, r) for i in row_reqs for r in range(q_lens[i])]
        kernel_decodes = _KernelDecodes(
            token_idx=torch.tensor([starts[i] + r for i, r in row_of], dtype=torch.int64),
            block_tables=meta.block_tables.index_select(0, torch.tensor([i for i, _ in row_of])).contiguous(),
            seq_lens=torch.tensor([s_lens[i] - q_lens[i] + r + 1 for i, r in row_of], dtype=torch.int32))
        decode_reqs = []
    for bucket in _bucket_decodes(decode_reqs, s_lens, block_size):
        nb = _blocks_for(max(s_lens[i] for i in bucket), block_size)
        idx = torch.tensor(bucket, dtype=torch.int64)
        lens = torch.tensor([s_lens[i] for i in bucket], dtype=torch.int64)
        mask = torch.arange(nb * block_size)[None, :] < lens[:, None]
        decodes.append(_DecodeBucket(
            token_idx=torch.tensor([starts[i] for i in bucket], dtype=torch.int64, device=device),
            block_ids=tables[idx, :nb].reshape(-1).to(device),
            num_blocks=nb,
            mask=mask[:, None, None, :].to(device),
        ))
        rows = max(rows, len(bucket) * nb)
    kernel_prefills = None
    prefill_reqs = [i for i, q in enumerate(q_lens) if q > (VERIFY_MAX_ROWS if use_kernel else 1)]
    if use_prefill_kernel and prefill_reqs:
        idx = torch.tensor(prefill_reqs, dtype=torch.int64)
        kernel_prefills = _KernelPrefills(
            block_tables=meta.block_tables.index_select(0, idx).contiguous(),
            seq_lens=torch.tensor([s_lens[i] for i in prefill_reqs], dtype=torch.int32),
            q_lens=torch.tensor([q_lens[i] for i in prefill_reqs], dtype=torch.int32),
            q_starts=torch.tensor([starts[i] for i in prefill_reqs], dtype=torch.int64))
        prefill_reqs = []
    for i in prefill_reqs:
        q, s = q_lens[i], s_lens[i]
        nb = _blocks_for(s, block_size)
        mask = None
        if s > q:  # query row r sits at position s - q + r and sees keys 0 .. s - q + r
            mask = (torch.arange(s)[None, :] <= torch.arange(s - q, s)[:, None]).to(device)
        prefills.append(_Prefill(starts[i], q, s, tables[i, :nb].to(device), mask))
        rows = max(rows, nb)
    rows_alone = kernel_decodes is not None and len(q_lens) == 1 and q_lens[0] > 1
    return _Plan(meta, block_size, use_kernel, decodes, kernel_decodes, use_prefill_kernel, kernel_prefills, prefills,
                 rows, rows_alone)


def _layout_fits(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """C++ kernels need CPU tensors (a pool of the query's dtype or int8), a contiguous pool and
    contiguous [H, D] query rows."""
    return (query.device.type == "cpu" and kv_cache.dtype in (query.dtype, torch.int8)
            and query.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
            and query.stride(2) == 1 and query.stride(1) == query.shape[2])


@functools.cache
def _prefill_dtypes(kernel) -> tuple[torch.dtype, ...]:
    """The query dtypes the prefill module's walks take on this CPU (bf16: AVX-512 BF16; float32: AVX2)."""
    return tuple(d for d, ok in ((torch.bfloat16, kernel.supported()), (torch.float32, kernel.supported_f32())) if ok)


class TorchPagedBackend:
    name = "torch"

    def __init__(self, use_kernel: bool | None = None) -> None:
        """use_kernel: decode with the C++ kernel when it loads (None: unless disabled). Unless asked
        for, the C++ kernels load at their first use on CPU tensors: a CUDA worker never builds them."""
        self._use_kernel = use_kernel
        self._kernels: tuple | None = None  # (decode, prefill) once loaded
        if use_kernel:
            self._load_kernels()
        self._plan: _Plan | None = None
        self._workspace: torch.Tensor | None = None  # flat, grow-only, reused by every layer

    def _load_kernels(self) -> tuple:
        if self._kernels is None:
            on = self._use_kernel is not False
            kernel = cpu_extensions.load("decode") if on else None
            if self._use_kernel and kernel is None:
                raise RuntimeError("the CPU decode kernel was asked for but could not be loaded")
            prefill = cpu_extensions.load("prefill") if on else None
            self._kernels = (kernel, prefill if prefill is not None and _prefill_dtypes(prefill) else None)
        return self._kernels

    @property
    def _kernel(self):
        return self._load_kernels()[0]

    @_kernel.setter
    def _kernel(self, kernel) -> None:
        self._kernels = (kernel, self._load_kernels()[1])

    @property
    def _prefill_kernel(self):
        return self._load_kernels()[1]

    @_prefill_kernel.setter
    def _prefill_kernel(self, kernel) -> None:
        self._kernels = (self._load_kernels()[0], kernel)

    def write_kv(self, key, value, kv_cache, meta: AttentionMetadata) -> None:
        if is_quantized(kv_cache) and self._kernel_fits(key, kv_cache) and _layout_fits(value, kv_cache):
            self._kernel.write_kv_int8(key, value, kv_cache, meta.slot_mapping)  # quantized as stored, one pass
            return
        # flat view [2, num_blocks * block_size, Hkv, D]: row = slot
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0].index_copy_(0, meta.slot_mapping, to_cache(key, kv_cache))
        flat[1].index_copy_(0, meta.slot_mapping, to_cache(value, kv_cache))

    def attend(self, query, kv_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        if window is not None or softcap is not None:  # Gemma's layers: plain torch (windowed.py)
            return attend_windowed(query, kv_cache, meta, scale, window, softcap)
        _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape  # width: D, or D + packed scales for int8
        num_heads, head_dim = query.shape[1], query.shape[2]
        group = num_heads // num_kv_heads
        layout_fits = _layout_fits(query, kv_cache)
        kernel = self._kernel if layout_fits else None
        prefill_kernel = self._prefill_kernel if layout_fits and self._prefill_fits(query, kv_cache) else None
        plan = self._plan_for(meta, block_size, kernel is not None, prefill_kernel is not None)
        # per block one contiguous row of block_size * Hkv * D elements: K at [0], V at [1]
        by_block = kv_cache.view(2, num_blocks, -1)
        ws = self._workspace_for(2 * plan.workspace_rows * by_block.shape[2], kv_cache)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if plan.kernel_decodes is not None:
            d = plan.kernel_decodes
            kernel.paged_decode_attention(out, query, kv_cache, d.block_tables, d.seq_lens, d.token_idx, scale,
                                          plan.rows_alone)
        for b in plan.decodes:
            n = b.token_idx.numel()
            kv = self._gather(by_block, b.block_ids, ws).view(2, n, -1, num_kv_heads, width)
            kv = from_cache(kv, query.dtype)
            q = query.index_select(0, b.token_idx).view(n, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=b.mask, scale=scale)
            out.index_copy_(0, b.token_idx, o.reshape(n, num_heads, head_dim))
        if plan.kernel_prefills is not None:
            p = plan.kernel_prefills  # an int8 pool's rows are dequantized once per step, in the kernel's pass 1
            prefill_kernel.paged_prefill_attention(out, query, kv_cache, p.block_tables, p.seq_lens, p.q_lens,
                                                   p.q_starts, scale)
        for p in plan.prefills:
            kv = from_cache(self._gather(by_block, p.block_ids, ws).view(2, -1, num_kv_heads, width), query.dtype)
            # K/V [Hkv, group (stride 0), s, D]; q [Hkv, group, q_len, D]
            k = kv[0, : p.seq_len].transpose(0, 1)[:, None].expand(-1, group, -1, -1)
            v = kv[1, : p.seq_len].transpose(0, 1)[:, None].expand(-1, group, -1, -1)
            q = query[p.start : p.start + p.q_len].view(p.q_len, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                q.permute(1, 2, 0, 3), k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale)
            out[p.start : p.start + p.q_len] = o.permute(2, 0, 1, 3).reshape(p.q_len, num_heads, head_dim)
        return out

    def _kernel_fits(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return _layout_fits(query, kv_cache) and self._kernel is not None

    def _prefill_fits(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        kernel = self._prefill_kernel
        if kernel is None or query.shape[2] not in (64, 128) or query.dtype not in _prefill_dtypes(kernel):
            return False
        if query.dtype == torch.float32:  # the AVX2 walk: a float32 pool, any block size
            return kv_cache.dtype == torch.float32
        return kv_cache.shape[2] % 16 == 0

    def _plan_for(self, meta: AttentionMetadata, block_size: int, use_kernel: bool, use_prefill_kernel: bool) -> _Plan:
        plan = self._plan
        if (plan is None or plan.meta is not meta or plan.block_size != block_size or plan.use_kernel != use_kernel
                or plan.use_prefill_kernel != use_prefill_kernel):
            plan = self._plan = _build_plan(meta, block_size, use_kernel, use_prefill_kernel)
        return plan

    def _workspace_for(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = self._workspace = torch.empty(numel, dtype=like.dtype, device=like.device)
        return ws

    @staticmethod
    def _gather(by_block: torch.Tensor, block_ids: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        """[2, n, row] copy of the listed blocks' K and V, in the workspace."""
        shape = (2, block_ids.numel(), by_block.shape[2])
        dst = ws[: shape[0] * shape[1] * shape[2]].view(shape)
        return torch.index_select(by_block, 1, block_ids, out=dst)
