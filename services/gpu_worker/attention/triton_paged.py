"""Paged attention in Triton (GPU; CPU under TRITON_INTERPRET=1): one program per (query tile, kv head),
tile row r = token r // GROUP, head kv_head * GROUP + r % GROUP, so K/V are read once per group."""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.services.gpu_worker.attention.kv_quant import group_size, is_quantized
from pagedserve.services.gpu_worker.attention.metadata import AttentionMetadata

LOG2_E = 1.4426950408889634
_LOG2_E = tl.constexpr(LOG2_E)  # compiled kernels read only constexpr globals
# as seen by the triton.jit decorations below: kernels then run on CPU tensors
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROWS_PER_TILE = 64  # target rows (token x group head) of a prefill tile
BLOCK_N = 32  # keys per inner step


# --- int8 rows (kv_quant.py): D int8 values in groups of GS, then the groups' 12-bit scales
# (float32 bits 19-30), a pair per 3 little-endian bytes: bits 0-11 the even group's ---
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + _ROUND) - _ROUND rounds a float32 |x| < 2**22 half to even


@triton.jit
def _group_bits(x, ok, d, g: tl.constexpr, GS: tl.constexpr):
    """12-bit scale of group g of the rows x [H_PAD, D_PAD]: max|x| / 127 rounded up, at least 16."""
    in_g = ok & (d >= g * GS) & (d < (g + 1) * GS)
    absmax = tl.max(tl.where(in_g, tl.abs(x), 0.0), 1)
    f32_bits = tl.math.div_rn(absmax, tl.full(absmax.shape, 127.0, tl.float32)).to(tl.int32, bitcast=True)
    return tl.maximum((f32_bits + 0x7FFFF) >> 19, 16)


@triton.jit
def _store_quantized(C, row, x, h_ok, d, HEAD_DIM: tl.constexpr, GS: tl.constexpr):
    """x float32 [H_PAD, D_PAD] -> int8 rows at C + row [H_PAD], as kv_quant.quantize (bit-exact)."""
    ok = h_ok[:, None] & (d < HEAD_DIM)
    scale = tl.full(x.shape, 1.0, tl.float32)
    for pair in tl.static_range((HEAD_DIM // GS + 1) // 2):
        lo = _group_bits(x, ok, d, 2 * pair, GS)
        scale = tl.where((d >= 2 * pair * GS) & (d < (2 * pair + 1) * GS),
                         (lo << 19).to(tl.float32, bitcast=True)[:, None], scale)
        hi = tl.zeros_like(lo)
        if 2 * pair + 1 < HEAD_DIM // GS:
            hi = _group_bits(x, ok, d, 2 * pair + 1, GS)
            scale = tl.where((d >= (2 * pair + 1) * GS) & (d < (2 * pair + 2) * GS),
                             (hi << 19).to(tl.float32, bitcast=True)[:, None], scale)
        packed = lo | (hi << 12)
        at = C + row + HEAD_DIM + 3 * pair
        tl.store(at, (packed & 0xFF).to(tl.int8), mask=h_ok)
        tl.store(at + 1, ((packed >> 8) & 0xFF).to(tl.int8), mask=h_ok)
        tl.store(at + 2, ((packed >> 16) & 0xFF).to(tl.int8), mask=h_ok)
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum((q + _ROUND) - _ROUND, -127.0), 127.0)
    tl.store(C + row[:, None] + d, q.to(tl.int8), mask=ok)


@triton.jit
def _row_scales(C, at, ok, d, HEAD_DIM: tl.constexpr, GS: tl.constexpr):
    """float32 [BLOCK_N, D_PAD]: each element's group scale, of the int8 rows at C + at [BLOCK_N]."""
    g = d // GS  # [1, D_PAD]
    byte = C + at[:, None] + HEAD_DIM + 3 * (g // 2)
    okd = ok[:, None] & (d < HEAD_DIM)
    b0 = tl.load(byte, mask=okd, other=0).to(tl.int32) & 0xFF
    b1 = tl.load(byte + 1, mask=okd, other=0).to(tl.int32) & 0xFF
    b2 = tl.load(byte + 2, mask=okd, other=0).to(tl.int32) & 0xFF
    packed = b0 | (b1 << 8) | (b2 << 16)
    bits = tl.where(g % 2 == 1, packed >> 12, packed & 0xFFF)
    return (bits << 19).to(tl.float32, bitcast=True)


@triton.jit
def _reshape_and_cache(K, V, KC, VC, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_cb, stride_cs, stride_ch, NUM_KV_HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr,
                       D_PAD: tl.constexpr, QUANT: tl.constexpr, GS: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    ok = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    heads = tl.arange(0, H_PAD)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch  # [H_PAD]
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=ok)
    if QUANT:
        _store_quantized(KC, row, k.to(tl.float32), heads < NUM_KV_HEADS, d, HEAD_DIM, GS)
        _store_quantized(VC, row, v.to(tl.float32), heads < NUM_KV_HEADS, d, HEAD_DIM, GS)
    else:
        tl.store(KC + row[:, None] + d, k.to(KC.dtype.element_ty), mask=ok)
        tl.store(VC + row[:, None] + d, v.to(VC.dtype.element_ty), mask=ok)


@triton.jit
def _paged_attention(Q, KC, VC, Out, block_tables, seq_lens, query_start, tile_seq, tile_q0,
                     qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs,
                     stride_ch, stride_bt, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
                     GS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq + tile)
    q0 = tl.load(tile_q0 + tile)  # first token of the tile, counted within the request
    q_begin = tl.load(query_start + seq)
    q_len = tl.load(query_start + seq + 1) - q_begin
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len  # keys cached before this step

    r = tl.arange(0, BLOCK_M)
    tok = q0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_len)
    pos = context + tok  # >= 0 for every row: without a window key 0 is visible, m_i finite after step 1
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    if UPCAST:  # the interpreter multiplies bf16 operands of tl.dot as raw uint16 bits
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, context + q0 + BLOCK_Q)  # one past the tile's last position
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(context + q0 - WINDOW + 1, 0)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for start in range(kv_begin, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        at = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + at[:, None] + d[None, :], mask=kv_ok, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(VC + at[:, None] + d[None, :], mask=kv_ok, other=0.0)
        if QUANT:  # int8 rows: dequantized here, in the query's dtype for the dots
            k = (k.to(tl.float32) * _row_scales(KC, at, n_ok, d[None, :], HEAD_DIM, GS)).to(q.dtype)
            v = (v.to(tl.float32) * _row_scales(VC, at, n_ok, d[None, :], HEAD_DIM, GS)).to(q.dtype)
        elif UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # log2 domain
        if SOFTCAP > 0:  # cap * tanh(score / cap) on the natural-log score; tanh x = 1 - 2 / (e^2x + 1)
            x = s * (1.0 / (_LOG2_E * SOFTCAP))
            s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (SOFTCAP * _LOG2_E)
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
        if WINDOW > 0:  # a row whose window starts past this step sees no key yet: subtract 0, not -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass
class _Launch:
    tile_seq: torch.Tensor  # int32 [tiles], request of each tile
    tile_q0: torch.Tensor  # int32 [tiles], first token of each tile within its request
    block_q: int


@dataclass
class _Plan:
    meta: AttentionMetadata  # held so that its id cannot be reused by a later step's metadata
    group: int
    launches: list[_Launch]


def _build_plan(meta: AttentionMetadata, group: int) -> _Plan:
    device = meta.seq_lens.device
    prefill_q = max(1, ROWS_PER_TILE // group)
    decode_seqs = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    prefill_tiles = [(i, t0) for i, q in enumerate(meta.query_lens_cpu) if q > 1
                     for t0 in range(0, q, prefill_q)]
    launches = []
    for tiles, block_q in (([(i, 0) for i in decode_seqs], 1), (prefill_tiles, prefill_q)):
        if tiles:
            seqs, q0s = zip(*tiles, strict=True)
            launches.append(_Launch(torch.tensor(seqs, dtype=torch.int32, device=device),
                                    torch.tensor(q0s, dtype=torch.int32, device=device), block_q))
    return _Plan(meta, group, launches)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("TritonPagedBackend needs GPU tensors; for CPU tensors set TRITON_INTERPRET=1 "
                           "before triton is first imported")


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonPagedBackend:
    name = "triton"

    def __init__(self) -> None:
        self._plan: _Plan | None = None

    def write_kv(self, key, value, kv_cache, meta: AttentionMetadata) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        _check_device(kv_cache)
        key, value = _last_dim_dense(key), _last_dim_dense(value)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _, block_size, num_kv_heads, _ = k_cache.shape
        head_dim = key.shape[2]
        _reshape_and_cache[(num_tokens,)](
            key, value, k_cache, v_cache, meta.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
            QUANT=is_quantized(kv_cache), GS=group_size(head_dim))

    def attend(self, query, kv_cache, meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        _check_device(kv_cache)
        query = _last_dim_dense(query)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _, block_size, num_kv_heads, _ = k_cache.shape
        head_dim = query.shape[2]
        group = query.shape[1] // num_kv_heads
        plan = self._plan
        if plan is None or plan.meta is not meta or plan.group != group:
            plan = self._plan = _build_plan(meta, group)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for launch in plan.launches:
            _paged_attention[(launch.tile_seq.numel(), num_kv_heads)](
                query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, launch.tile_seq, launch.tile_q0, scale * LOG2_E,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
                GROUP=group, BLOCK_Q=launch.block_q,
                BLOCK_M=max(16, triton.next_power_of_2(launch.block_q * group)), BLOCK_N=BLOCK_N,
                BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
                UPCAST=INTERPRETED and query.dtype == torch.bfloat16, QUANT=is_quantized(kv_cache),
                GS=group_size(head_dim), WINDOW=window or 0, SOFTCAP=float(softcap or 0.0))
        return out
