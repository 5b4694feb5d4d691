// cpu_prefill.cpp's float32 walk for AVX2 + FMA CPUs without AVX-512 (the float32 model's CPUs):
// the same flash-attention order (key chunks in order, online softmax, no score matrix) on a
// float32 pool. Pass 1 copies each (request, KV head)'s K transposed per chunk of 16 keys and its
// V rows, zero past seq_len; pass 2 deals out tiles of kRowsF32 (position, head of the group) rows,
// latest first. Scores and sums are float32; exp is a degree-6 polynomial (rel. error < 2e-7).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

// AVX-512 builds keep SDPA for float32 (this walk is measured on AVX2 CPUs only)
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGEDSERVE_PREFILL_F32 1
#else
#define PAGEDSERVE_PREFILL_F32 0
#endif
#if PAGEDSERVE_PREFILL_F32
#include <immintrin.h>

namespace f32 {

constexpr int kKeys = 16;     // keys per chunk: two ymm of scores
constexpr int kRowsF32 = 6;   // query rows per tile: 12 score accumulators
constexpr float kNoScore = -1e30f;

// exp(x) for x <= 0, exactly 0 below -87 (masked keys): 2^n * e^f, |f| <= ln2 / 2
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), x);
  __m256 p = _mm256_set1_ps(1.f / 720);  // Horner, Taylor coefficients 1/6! .. 1/0!
  for (const float coefficient : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(coefficient));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), live);
}

inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

struct Item {
  const float* kt;  // [chunks][DH][kKeys]
  const float* v;   // [chunks * kKeys][DH]
  int64_t q_start, q_len, seq_len;
};

// sc[r][j] = q_rows[r] . key j of the chunk kt [DH][kKeys]; the accumulators stay in registers
template <int R, int DH>
inline void scores(float (&sc)[R][kKeys], const float* const (&q_rows)[R], const float* kt) {
  __m256 s[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
  for (int d = 0; d < DH; ++d) {
    const __m256 k0 = _mm256_load_ps(kt + d * kKeys), k1 = _mm256_load_ps(kt + d * kKeys + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_broadcast_ss(q_rows[r] + d);
      s[r][0] = _mm256_fmadd_ps(qv, k0, s[r][0]);
      s[r][1] = _mm256_fmadd_ps(qv, k1, s[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_store_ps(sc[r], s[r][0]), _mm256_store_ps(sc[r] + 8, s[r][1]);
}

// Pass 2, one tile: rows [row0, row0 + kRowsF32) of `it`; row i = position i / G, head kv_head * G + i % G
template <int DH>
void tile(float* out, const float* q, const Item& it, int64_t row0, int64_t G, int64_t H, int64_t q_stride,
          int64_t kv_head, float scale) {
  constexpr int R = kRowsF32;
  const int64_t num_rows = std::min<int64_t>(R, it.q_len * G - row0);
  const int64_t first_pos = it.seq_len - it.q_len;
  const float* q_rows[R] = {};
  float* o_rows[R];
  int32_t q_pos[R];
  for (int r = 0; r < R; ++r) {
    const int64_t i = row0 + std::min<int64_t>(r, num_rows - 1);  // padding rows repeat the last
    q_rows[r] = q + (it.q_start + i / G) * q_stride + (kv_head * G + i % G) * DH;
    o_rows[r] = out + ((it.q_start + i / G) * H + kv_head * G + i % G) * DH;
    q_pos[r] = static_cast<int32_t>(first_pos + i / G);
  }
  const int64_t num_chunks = (first_pos + (row0 + num_rows - 1) / G) / kKeys + 1;
  const int64_t first_masked_chunk = q_pos[0] / kKeys;
  alignas(32) float o[R][DH] = {};
  alignas(32) float p[R][kKeys], sc[R][kKeys];
  float m[R], l[R], corr[R];
  std::fill(m, m + R, kNoScore);
  std::fill(l, l + R, 0.f);
  const __m256 scale_v = _mm256_set1_ps(scale);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t c = 0; c < num_chunks; ++c) {
    scores<R, DH>(sc, q_rows, it.kt + c * DH * kKeys);
    const __m256i pos0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(c * kKeys)), iota);
    const __m256i pos1 = _mm256_add_epi32(pos0, _mm256_set1_epi32(8));
    for (int r = 0; r < R; ++r) {
      __m256 x0 = _mm256_mul_ps(_mm256_load_ps(sc[r]), scale_v), x1 = _mm256_mul_ps(_mm256_load_ps(sc[r] + 8), scale_v);
      if (c >= first_masked_chunk) {  // keys after the row's position (and past seq_len) drop out
        const __m256i row_pos = _mm256_set1_epi32(q_pos[r]);
        x0 = _mm256_blendv_ps(x0, _mm256_set1_ps(kNoScore), _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos0, row_pos)));
        x1 = _mm256_blendv_ps(x1, _mm256_set1_ps(kNoScore), _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos1, row_pos)));
      }
      const float new_m = std::max(m[r], hmax(_mm256_max_ps(x0, x1)));
      const __m256 new_m_v = _mm256_set1_ps(new_m);
      const __m256 p0 = exp_nonpositive(_mm256_sub_ps(x0, new_m_v)), p1 = exp_nonpositive(_mm256_sub_ps(x1, new_m_v));
      corr[r] = m[r] == kNoScore ? 0.f : std::exp(m[r] - new_m);
      l[r] = l[r] * corr[r] + hsum(_mm256_add_ps(p0, p1));
      m[r] = new_m;
      _mm256_store_ps(p[r], p0);
      _mm256_store_ps(p[r] + 8, p1);
    }
    const float* v = it.v + c * kKeys * DH;
    for (int d0 = 0; d0 < DH; d0 += 16) {  // O = O * corr + P V, 16 dims at a time
      __m256 acc[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 cr = _mm256_set1_ps(corr[r]);
        acc[r][0] = _mm256_mul_ps(_mm256_load_ps(&o[r][d0]), cr);
        acc[r][1] = _mm256_mul_ps(_mm256_load_ps(&o[r][d0 + 8]), cr);
      }
      for (int j = 0; j < kKeys; ++j) {
        const __m256 v0 = _mm256_load_ps(v + j * DH + d0), v1 = _mm256_load_ps(v + j * DH + d0 + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 pv = _mm256_broadcast_ss(&p[r][j]);
          acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(&o[r][d0], acc[r][0]);
        _mm256_store_ps(&o[r][d0 + 8], acc[r][1]);
      }
    }
  }
  for (int r = 0; r < num_rows; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / l[r]);
    for (int d = 0; d < DH; d += 8) _mm256_storeu_ps(o_rows[r] + d, _mm256_mul_ps(_mm256_load_ps(&o[r][d]), inv));
  }
}

// Pass 1, one (request, KV head): K^T chunks and V rows from a float32 pool, zero past seq_len
template <int DH>
void lay_out(float* kt, float* v, const float* k_pool, const float* v_pool, const int32_t* table, int64_t seq_len,
             int64_t BS, int64_t token_stride, int64_t kv_head) {
  const int64_t num_chunks = (seq_len + kKeys - 1) / kKeys;
  std::memset(kt, 0, num_chunks * kKeys * DH * 4);
  std::memset(v + seq_len * DH, 0, (num_chunks * kKeys - seq_len) * DH * 4);
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t offset = table[t / BS] * BS * token_stride + (t % BS) * token_stride + kv_head * DH;
    float* kt_chunk = kt + (t / kKeys) * DH * kKeys + t % kKeys;
    for (int d = 0; d < DH; ++d) kt_chunk[d * kKeys] = k_pool[offset + d];
    std::memcpy(v + t * DH, v_pool + offset, DH * 4);
  }
}

// query [T, H, DH] (rows may be strided), out [T, H, DH], kv_cache [2, NB, BS, Hkv, DH]: all float32
template <int DH>
void prefill(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
             torch::Tensor seq_lens, torch::Tensor q_lens, torch::Tensor q_starts, float scale) {
  const int64_t P = seq_lens.size(0), H = query.size(1);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = H / Hkv, max_blocks = block_tables.size(1), token_stride = Hkv * DH;
  const float* k_pool = kv_cache.data_ptr<float>();
  const float* v_pool = k_pool + NB * BS * token_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = q_lens.data_ptr<int32_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  std::vector<int64_t> offset(P * Hkv + 1, 0);  // per (request, KV head): K^T then V, 2 * chunks * kKeys * DH
  for (int64_t item = 0; item < P * Hkv; ++item)
    offset[item + 1] = offset[item] + 2 * ((lens[item / Hkv] + kKeys - 1) / kKeys) * kKeys * DH;
  float* layout = static_cast<float*>(std::aligned_alloc(32, std::max<int64_t>(8, offset.back()) * 4));
  std::vector<Item> items(P * Hkv);
  at::parallel_for(0, P * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / Hkv;
      float* kt = layout + offset[item];
      float* v = kt + (offset[item + 1] - offset[item]) / 2;
      lay_out<DH>(kt, v, k_pool, v_pool, tables + p * max_blocks, lens[p], BS, token_stride, item % Hkv);
      items[item] = Item{kt, v, starts[p], qlens[p], lens[p]};
    }
  });
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (item, first row), latest position first
  for (int64_t item = 0; item < P * Hkv; ++item)
    for (int64_t row0 = 0; row0 < items[item].q_len * G; row0 += kRowsF32) tiles.emplace_back(item, row0);
  std::stable_sort(tiles.begin(), tiles.end(), [&](const auto& a, const auto& b) {
    const Item &x = items[a.first], &y = items[b.first];
    return x.seq_len - x.q_len + a.second / G > y.seq_len - y.q_len + b.second / G;
  });
  float* o = out.data_ptr<float>();
  const float* q = query.data_ptr<float>();
  const int64_t q_stride = query.stride(0), num_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(dynamic, 1)
  for (int64_t t = 0; t < num_tiles; ++t)
    tile<DH>(o, q, items[tiles[t].first], tiles[t].second, G, H, q_stride, tiles[t].first % Hkv, scale);
  std::free(layout);
}

}  // namespace f32
#endif

inline bool supported_f32() {
#if PAGEDSERVE_PREFILL_F32
  return true;
#else
  return false;
#endif
}

inline void prefill_f32(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                        torch::Tensor seq_lens, torch::Tensor q_lens, torch::Tensor q_starts, double scale) {
  TORCH_CHECK(supported_f32(), "paged_prefill_attention: float32 needs a build with AVX2 and FMA");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat &&
                  kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "paged_prefill_attention: float32 query, out and pool rows of head_dim");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() &&
                  kv_cache.is_contiguous() && block_tables.is_contiguous() && seq_lens.scalar_type() == torch::kInt32 &&
                  q_lens.scalar_type() == torch::kInt32 && q_starts.scalar_type() == torch::kInt64 &&
                  block_tables.scalar_type() == torch::kInt32,
              "paged_prefill_attention: contiguous tensors, int32 tables and lengths, int64 q_starts");
#if PAGEDSERVE_PREFILL_F32
  const float s = static_cast<float>(scale);
  if (query.size(2) == 64) return f32::prefill<64>(out, query, kv_cache, block_tables, seq_lens, q_lens, q_starts, s);
  if (query.size(2) == 128) return f32::prefill<128>(out, query, kv_cache, block_tables, seq_lens, q_lens, q_starts, s);
#endif
  TORCH_CHECK(false, "paged_prefill_attention: head_dim 64 or 128 only");
}

