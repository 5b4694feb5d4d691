// Paged causal prefill attention on the CPU, bf16, for CPUs with AVX-512 BF16 (vdpbf16ps):
// a flash-attention walk (tiles of 16 query rows, key chunks in order, online softmax), so no
// [q_len, seq_len] score matrix is built. Query rows are positions seq_len - q_len .. seq_len - 1.
//   query, out [T, H, D] (query may be strided); kv_cache [2, NB, BS, Hkv, D] bf16, or int8
//   [.., D + S] (kv_quant.py's rows, dequantized in pass 1), BS % 16 == 0, D 64 or 128; block_tables [P, max_blocks] int32; seq_lens, q_lens [P] int32; q_starts [P] int64.
// Pass 1 copies each (request, KV head)'s K and V once into vdpbf16ps layouts; pass 2 deals out
// (request, KV head, 16-row tile) items dynamically (later tiles see more keys); a tile's rows are
// (position, head of the group) pairs, so a group's heads share every K/V load. P is rounded to
// bf16 before O += P V, as torch's CPU flash attention does. With AMX (and the tile state
// granted), chunks of 32 keys and both products on tiles; use_amx(false) keeps vdpbf16ps.
// supported() is false without AVX-512 BF16: the caller keeps SDPA. float32 (query, out, pool) takes
// cpu_prefill_f32.h's AVX2 walk where supported_f32().
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PAGEDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kv_int8.h"
#include "cpu_prefill_layout.h"  // kKeys, Prefill, lay_out (pass 1)
#include "cpu_prefill_f32.h"     // f32::prefill
#include "cpu_prefill_softmax.h" // exp_nonpositive, RowState, write_rows (AVX-512 BF16)

namespace {

#if defined(__AVX512BF16__)
constexpr int kSub = 4;             // layout chunks (kKeys keys each) per online-softmax update

// Pass 2, one tile: rows [row0, row0 + kRows) of `pf` at kv_head; row i = position i / G, head kv_head * G + i % G
template <int DH>
void tile(uint16_t* out, const uint16_t* q, const Prefill& pf, int64_t row0, int64_t G, int64_t H,
          int64_t q_stride, int64_t kv_head, float scale) {
  constexpr int DV = DH / 16;    // zmm of fp32 per output row
  constexpr int RG = 16 / DV;    // rows per PV group: RG * DV accumulators
  const int64_t num_rows = std::min<int64_t>(kRows, pf.q_len * G - row0);
  const int64_t first_pos = pf.seq_len - pf.q_len;  // position of the chunk's first query token
  const uint32_t* q_rows[kRows];
  int32_t q_pos[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + std::min<int64_t>(r, num_rows - 1);  // padding rows repeat the last
    q_rows[r] = reinterpret_cast<const uint32_t*>(q + (pf.q_start + i / G) * q_stride + (kv_head * G + i % G) * DH);
    q_pos[r] = static_cast<int32_t>(first_pos + i / G);
  }
  const int64_t last_pos = first_pos + (row0 + num_rows - 1) / G;
  const int64_t num_chunks = last_pos / kKeys + 1;
  const int64_t first_masked_chunk = q_pos[0] / kKeys;  // chunks before it are visible to every row
  // softmax state moves once per kSub chunks: the row max, its correction and the sum of P once per 64 keys
  alignas(64) float scores[kRows][kSub * kKeys];
  alignas(64) uint32_t p_pairs[kRows][kSub * kKeys / 2];
  RowState<DH> st;
  auto &o = st.o;
  float *m = st.m, *l = st.l, *correction = st.correction;
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t c0 = 0; c0 < num_chunks; c0 += kSub) {
    const int num_sub = static_cast<int>(std::min<int64_t>(kSub, num_chunks - c0));
    for (int u = 0; u < num_sub; ++u) {
      const int64_t c = c0 + u;
      __m512 s[kRows];
      for (int r = 0; r < kRows; ++r) s[r] = _mm512_setzero_ps();
      const uint32_t* kt = pf.kt + c * (DH / 2) * kKeys;
      for (int i = 0; i < DH / 2; ++i) {
        const __m512bh k = as_bh(_mm512_loadu_si512(kt + i * kKeys));
        for (int r = 0; r < kRows; ++r) s[r] = _mm512_dpbf16_ps(s[r], as_bh(_mm512_set1_epi32(q_rows[r][i])), k);
      }
      const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c * kKeys)), iota);
      for (int r = 0; r < kRows; ++r) {
        __m512 x = _mm512_mul_ps(s[r], scale_v);
        if (c >= first_masked_chunk) {  // keys after the row's position, and past seq_len, drop out
          const __mmask16 visible = _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(q_pos[r]));
          x = _mm512_mask_blend_ps(visible, _mm512_set1_ps(kNoScore), x);
        }
        _mm512_store_ps(&scores[r][u * kKeys], x);
      }
    }
    for (int r = 0; r < kRows; ++r)
      correction[r] = softmax_update(scores[r], num_sub, reinterpret_cast<uint16_t*>(p_pairs[r]), m[r], l[r]);
    const uint32_t* vp = pf.vp + c0 * (kKeys / 2) * DH;  // chunks lie back to back: j runs over num_sub of them
    const int num_pairs = num_sub * kKeys / 2;
    for (int r0 = 0; r0 < kRows; r0 += RG) {
      __m512 acc[RG][DV];
      for (int rr = 0; rr < RG; ++rr) {
        const __m512 corr = _mm512_set1_ps(correction[r0 + rr]);
        for (int dv = 0; dv < DV; ++dv) acc[rr][dv] = _mm512_mul_ps(_mm512_load_ps(&o[r0 + rr][16 * dv]), corr);
      }
      for (int j = 0; j < num_pairs; ++j) {
        for (int dv = 0; dv < DV; ++dv) {
          const __m512bh v = as_bh(_mm512_loadu_si512(vp + j * DH + 16 * dv));
          for (int rr = 0; rr < RG; ++rr)
            acc[rr][dv] = _mm512_dpbf16_ps(acc[rr][dv], as_bh(_mm512_set1_epi32(p_pairs[r0 + rr][j])), v);
        }
      }
      for (int rr = 0; rr < RG; ++rr)
        for (int dv = 0; dv < DV; ++dv) _mm512_store_ps(&o[r0 + rr][16 * dv], acc[rr][dv]);
    }
  }
  write_rows<DH>(out, st, pf, row0, num_rows, G, H, kv_head);
}

#if defined(PAGEDSERVE_AMX)
constexpr int kAmxKeys = 32;  // keys per AMX chunk: two layout chunks of kKeys

// Linux hands out the AMX tile state on request only (once per process).
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: tmm0 A (Q part, then P), tmm1-3 B (K, then V parts), tmm2-3 S (keys 0-15, 16-31), tmm4-7 P V
// (64 dims); all 16 rows x 64 bytes
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

constexpr int kAmxSub = 4;  // AMX chunks per online-softmax update: the row state moves once per 128 keys
constexpr int kRoundKeys = kAmxSub * kAmxKeys;

// tile<DH>'s walk on AMX: same rows, same output; S per chunk of 32 keys, the softmax per 128 keys,
// P V summed over those chunks in tiles 4-7 before it meets O
template <int DH>
void tile_amx(uint16_t* out, const uint16_t* q, const Prefill& pf, int64_t row0, int64_t G, int64_t H,
              int64_t q_stride, int64_t kv_head, float scale) {
  const int64_t num_rows = std::min<int64_t>(kRows, pf.q_len * G - row0);
  const int64_t first_pos = pf.seq_len - pf.q_len;
  alignas(64) uint16_t q_tile[kRows][DH];     // A rows for S, row-major
  alignas(64) float s[kRows][kRoundKeys];     // S of one round
  alignas(64) uint16_t p[kRows][kRoundKeys];  // P in bf16, A rows for PV
  alignas(64) float pv[kRows][64];            // P V for 64 dims
  int32_t q_pos[kRows];
  RowState<DH> st;
  auto &o = st.o;
  float *m = st.m, *l = st.l;
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + std::min<int64_t>(r, num_rows - 1);  // padding rows repeat the last
    std::memcpy(q_tile[r], q + (pf.q_start + i / G) * q_stride + (kv_head * G + i % G) * DH, DH * 2);
    q_pos[r] = static_cast<int32_t>(first_pos + i / G);
  }
  const int64_t last_pos = first_pos + (row0 + num_rows - 1) / G;
  const int64_t num_chunks = last_pos / kAmxKeys + 1;
  const int64_t first_masked_chunk = q_pos[0] / kAmxKeys;  // chunks before it are visible to every row
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t c0 = 0; c0 < num_chunks; c0 += kAmxSub) {
    const int num_sub = static_cast<int>(std::min<int64_t>(kAmxSub, num_chunks - c0));
    for (int u = 0; u < num_sub; ++u) {  // S = Q K^T: per 32 dims of Q (A), the matching 16 pair rows of K (B)
      const uint32_t* kt = pf.kt + 2 * (c0 + u) * (DH / 2) * kKeys;
      _tile_zero(2);
      _tile_zero(3);
      for (int part = 0; part < DH / 32; ++part) {
        _tile_loadd(0, &q_tile[0][32 * part], DH * 2);
        _tile_loadd(1, kt + part * 16 * kKeys, kKeys * 4);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kt + (DH / 2) * kKeys + part * 16 * kKeys, kKeys * 4);
        _tile_dpbf16ps(3, 0, 1);
      }
      _tile_stored(2, &s[0][u * kAmxKeys], kRoundKeys * 4);
      _tile_stored(3, &s[0][u * kAmxKeys + 16], kRoundKeys * 4);
    }
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < 2 * num_sub; ++j) {  // 16 keys each, scaled; keys after the row's position drop out
        __m512 x = _mm512_mul_ps(_mm512_load_ps(&s[r][16 * j]), scale_v);
        if (c0 + j / 2 >= first_masked_chunk) {
          const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0 * kAmxKeys + 16 * j)), iota);
          x = _mm512_mask_blend_ps(_mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(q_pos[r])),
                                   _mm512_set1_ps(kNoScore), x);
        }
        _mm512_store_ps(&s[r][16 * j], x);
      }
      st.correction[r] = softmax_update(s[r], 2 * num_sub, p[r], m[r], l[r]);
    }
    // O = O * correction + P V, 64 dims at a time: per chunk, P (A) meets V's 16 pair rows (B) of each 16 dims
    for (int d0 = 0; d0 < DH; d0 += 64) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int u = 0; u < num_sub; ++u) {
        const uint32_t* vp = pf.vp + (c0 + u) * (kAmxKeys / 2) * DH + d0;
        _tile_loadd(0, &p[0][u * kAmxKeys], kRoundKeys * 2);
        _tile_loadd(1, vp, DH * 4);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(2, vp + 16, DH * 4);
        _tile_dpbf16ps(5, 0, 2);
        _tile_loadd(3, vp + 32, DH * 4);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, vp + 48, DH * 4);
        _tile_dpbf16ps(7, 0, 1);
      }
      _tile_stored(4, &pv[0][0], 64 * 4);
      _tile_stored(5, &pv[0][16], 64 * 4);
      _tile_stored(6, &pv[0][32], 64 * 4);
      _tile_stored(7, &pv[0][48], 64 * 4);
      for (int r = 0; r < kRows; ++r) {
        const __m512 corr = _mm512_set1_ps(st.correction[r]);
        for (int dv = 0; dv < 4; ++dv) {
          float* o_r = &o[r][d0 + 16 * dv];
          _mm512_store_ps(o_r, _mm512_fmadd_ps(_mm512_load_ps(o_r), corr, _mm512_load_ps(&pv[r][16 * dv])));
        }
      }
    }
  }
  write_rows<DH>(out, st, pf, row0, num_rows, G, H, kv_head);
}
#endif

bool amx_enabled = true;  // use_amx(): the AMX walk where it can run

bool amx_usable() {
#if defined(PAGEDSERVE_AMX)
  return amx_enabled && amx_granted();
#else
  return false;
#endif
}

template <int DH, typename kv_t>
void prefill(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
             torch::Tensor seq_lens, torch::Tensor q_lens, torch::Tensor q_starts, float scale) {
  const int64_t P = seq_lens.size(0), H = query.size(1);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t W = kv_cache.size(4), G = H / Hkv, max_blocks = block_tables.size(1), token_stride = Hkv * W;
  const kv_t* k_pool = static_cast<const kv_t*>(kv_cache.data_ptr());
  const kv_t* v_pool = k_pool + NB * BS * token_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = q_lens.data_ptr<int32_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  // pass 1: per (request, KV head) its laid-out K and V, at offsets in one buffer
  std::vector<int64_t> offset(P * Hkv + 1, 0);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t num_chunks = 2 * ((lens[p] + 2 * kKeys - 1) / (2 * kKeys));  // even: AMX reads 32 keys
      offset[p * Hkv + h + 1] = offset[p * Hkv + h] + num_chunks * kKeys * DH;  // K then V, each chunk*16*DH/2
    }
  std::vector<uint32_t> layout(offset.back());
  std::vector<Prefill> items(P * Hkv);
  at::parallel_for(0, P * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / Hkv, h = item % Hkv;
      uint32_t* kt = layout.data() + offset[item];
      uint32_t* vp = kt + (offset[item + 1] - offset[item]) / 2;
      lay_out<DH>(kt, vp, k_pool, v_pool, tables + p * max_blocks, lens[p], BS, token_stride, W, h);
      items[item] = Prefill{kt, vp, starts[p], qlens[p], lens[p]};
    }
  });
  // pass 2: tiles of 16 query rows, most expensive (latest) first, dealt out dynamically
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (item, first row)
  for (int64_t item = 0; item < P * Hkv; ++item)
    for (int64_t row0 = 0; row0 < items[item].q_len * G; row0 += kRows) tiles.emplace_back(item, row0);
  std::stable_sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) {
    const Prefill &x = items[a.first], &y = items[b.first];
    return x.seq_len - x.q_len + a.second / G > y.seq_len - y.q_len + b.second / G;
  });
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const uint16_t* q = reinterpret_cast<const uint16_t*>(query.data_ptr<c10::BFloat16>());
  const int64_t q_stride = query.stride(0), num_tiles = static_cast<int64_t>(tiles.size());
  const bool amx = amx_usable();
#pragma omp parallel num_threads(at::get_num_threads())
  {
#if defined(PAGEDSERVE_AMX)
    if (amx) configure_tiles();  // per thread
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const auto [item, row0] = tiles[t];
#if defined(PAGEDSERVE_AMX)
      if (amx) {
        tile_amx<DH>(o, q, items[item], row0, G, H, q_stride, item % Hkv, scale);
        continue;
      }
#endif
      tile<DH>(o, q, items[item], row0, G, H, q_stride, item % Hkv, scale);
    }
#if defined(PAGEDSERVE_AMX)
    if (amx) _tile_release();
#endif
  }
}
#endif

}  // namespace

// use_amx(false): the vdpbf16ps walk even where AMX runs (tests both); returns whether AMX is in use
bool use_amx(bool enabled) {
#if defined(__AVX512BF16__)
  amx_enabled = enabled;
  return amx_usable();
#else
  return false;
#endif
}

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                             torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor q_lens,
                             torch::Tensor q_starts, double scale) {
  if (query.scalar_type() == torch::kFloat) return prefill_f32(out, query, kv_cache, block_tables, seq_lens, q_lens, q_starts, scale);
  TORCH_CHECK(supported(), "paged_prefill_attention: built without AVX-512 BF16");
  const bool int8_kv = kv_cache.scalar_type() == torch::kInt8;
  TORCH_CHECK(query.scalar_type() == torch::kBFloat16 && (kv_cache.scalar_type() == torch::kBFloat16 || int8_kv) &&
                  out.scalar_type() == torch::kBFloat16,
              "paged_prefill_attention: bfloat16 query and out, a bfloat16 or int8 pool");
  TORCH_CHECK(kv_cache.size(4) == (int8_kv ? kv_int8::width(query.size(2)) : query.size(2)),
              "paged_prefill_attention: kv_cache rows must be head_dim wide (int8: and the packed scales)");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() &&
                  kv_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_prefill_attention: contiguous tensors only (query: rows may be strided)");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0 && kv_cache.size(2) % 16 == 0,
              "paged_prefill_attention: num_heads a multiple of num_kv_heads, block_size of 16");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && q_lens.scalar_type() == torch::kInt32 &&
                  q_starts.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt32,
              "paged_prefill_attention: int32 block_tables, seq_lens, q_lens; int64 q_starts");
#if defined(__AVX512BF16__)
  const float s = static_cast<float>(scale);
  auto run = [&](auto dh) {
    constexpr int DH = decltype(dh)::value;
    if (int8_kv) return prefill<DH, int8_t>(out, query, kv_cache, block_tables, seq_lens, q_lens, q_starts, s);
    prefill<DH, uint16_t>(out, query, kv_cache, block_tables, seq_lens, q_lens, q_starts, s);
  };
  if (query.size(2) == 64) return run(std::integral_constant<int, 64>{});
  if (query.size(2) == 128) return run(std::integral_constant<int, 128>{});
#endif
  TORCH_CHECK(false, "paged_prefill_attention: head_dim 64 or 128 only");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the AVX-512 BF16 kernel");
  m.def("supported_f32", &supported_f32, "whether this build has the float32 AVX2 walk");
  m.def("use_amx", &use_amx, "turn the AMX walk on or off; whether it is now in use");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal prefill attention (CPU, bf16; bf16 or int8 pool)",
        py::call_guard<py::gil_scoped_release>());
}
