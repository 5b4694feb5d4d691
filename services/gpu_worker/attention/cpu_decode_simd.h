// cpu_decode.cpp's vector walk for any CPU with AVX2 + FMA (8 lanes) or AVX-512 (16): float32
// and bf16 storage alike. The bf16 path with vdpbf16ps (AVX-512 BF16) stays in cpu_decode.cpp.
#pragma once
#include "cpu_decode_work.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// 16 float lanes (AVX-512): what decode_simd needs of a vector type
struct Vec16 {
  using T = __m512;
  static constexpr int kLanes = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const c10::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  // lane j = the sum of v[j]'s lanes, j < 16: a transpose-add tree of 45 shuffles and adds,
  // where 16 separate reductions take about 130
  static T sum_lanes(const T* v) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
      x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of 4 vectors
      const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
      y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    return sum_quarters(y);
  }
  // lane 4k + j = the sum of element j of y[k]'s four 128-bit lanes, k < 4 (sum_lanes's last levels)
  static T sum_quarters(const T* y) {
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_DECODE_SIMD 1
// 8 float lanes (AVX2 + FMA): the same walk on CPUs without AVX-512.
struct Vec8 {
  using T = __m256;
  static constexpr int kLanes = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const c10::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  // lane j = the sum of v[j]'s lanes, j < 8: three levels of pairwise adds, one 128-bit swap
  static T sum_lanes(const T* v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
};
#endif

#if defined(PAGEDSERVE_DECODE_SIMD)
// The same walk with vector intrinsics (V: Vec16 or Vec8), D = V::kLanes * DV: K/V rows
// widened a vector at a time, a score is DV fused multiply-adds, kLanes tokens' scores are
// reduced together (sum_lanes: one transpose-add tree, not kLanes horizontal adds), and
// the PV update is DV broadcast-FMAs per head with the accumulators in L1 (the portable
// loop's bf16 widening and short reductions do not vectorise).
// DV vectors per row, G query heads per KV head, both compile-time so that a group's query
// rows and output accumulators (G * DV vectors each) stay in registers for a block (with 16
// lanes; with 8 some spill to L1).
// int8 pools take cpu_decode_int8.h's walk instead.
template <typename V, typename scalar_t, int DV, int G>
void decode_simd(scalar_t* o, const scalar_t* q, const scalar_t* k_pool, const scalar_t* v_pool,
                 const int32_t* tables, const int32_t* lens, const int64_t* rows, int64_t num_reqs,
                 int64_t q_stride, int64_t Hkv, int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = V::kLanes * DV;
  const int64_t H = Hkv * G;
  const int64_t token_stride = Hkv * D;
  const int64_t block_elems = BS * token_stride;  // one block's K (or V): BS * Hkv * D contiguous
  // One work item per request: its blocks in order, each block's K and V fetched once (the
  // next block is prefetched while this one is computed: a request's blocks lie anywhere in
  // the pool, which the hardware prefetcher cannot guess), then per KV head the group's
  // scores, the online-softmax update and the PV sum with the accumulators in registers.
  WorkQueue queue(lens, num_reqs, BS);
  Partials partials(queue.num_parts(), H, D);
  on_every_thread([&] {
    // qf [H, D] scaled query rows; acc [H, D]; p [G, BS] one group's scores, then weights
    std::vector<float> qf(H * D), acc(H * D), p(G * BS), m(H), l(H);
    BlockPrefetch next;
    constexpr int64_t GB = V::kLanes == 16 ? G : 1;  // heads a pass (below)
    const int64_t steps = Hkv * (G / GB) * ((BS + V::kLanes - 1) / V::kLanes + BS);  // next.ahead() a block
    for (WorkItem item; queue.next(item);) {
      const int64_t r = item.r;
      const scalar_t* q_rows = q + rows[r] * q_stride;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = widen(q_rows[i]) * scale;
      reset_item(acc, m, l);
      const int64_t len = lens[r];
      const int32_t* table = tables + r * max_blocks;
      for (int64_t b = item.begin; b < item.end; ++b) {
        const int64_t num_tokens = std::min(BS, len - b * BS);
        const scalar_t* k_block = k_pool + table[b] * block_elems;
        const scalar_t* v_block = v_pool + table[b] * block_elems;
        if (b + 1 < item.end)
          next.start(k_pool + table[b + 1] * block_elems, v_pool + table[b + 1] * block_elems,
                     block_elems * int64_t(sizeof(scalar_t)), steps);
        else
          next.start(nullptr, nullptr, 0, steps);
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head) {
          const int64_t h0 = kv_head * G;  // the group's first query head
          // GB heads of the group at a time: all G with 16 lanes (their rows fit in the
          // registers), one with 8 (then the block's K/V rows come from L1 again per head)
          for (int g0 = 0; g0 < G; g0 += GB) {
            typename V::T qv[GB][DV];
            for (int g = 0; g < GB; ++g)
              for (int i = 0; i < DV; ++i) qv[g][i] = V::load(qf.data() + (h0 + g0 + g) * D + V::kLanes * i);
            for (int64_t t0 = 0; t0 < num_tokens; t0 += V::kLanes) {
              const int64_t n = std::min<int64_t>(V::kLanes, num_tokens - t0);
              next.ahead();
              typename V::T part[GB][V::kLanes];  // per head, token t0 + j's products in part[g][j]
              const scalar_t* k_rows = k_block + t0 * token_stride + kv_head * D;
              if (GB == 1 && n == V::kLanes) {
                // one head, a full vector of tokens: the kLanes dot products advance together (i
                // outer), so kLanes independent FMA chains hide the FMA latency; per token the same
                // operations in the same order as below
                for (int64_t j = 0; j < V::kLanes; ++j)
                  part[0][j] = V::mul(qv[0][0], V::load(k_rows + j * token_stride));
                for (int i = 1; i < DV; ++i)
                  for (int64_t j = 0; j < V::kLanes; ++j)
                    part[0][j] = V::fmadd(qv[0][i], V::load(k_rows + j * token_stride + V::kLanes * i), part[0][j]);
              } else {
                for (int64_t j = 0; j < V::kLanes; ++j) {
                  if (j >= n) {
                    for (int g = 0; g < GB; ++g) part[g][j] = V::set1(0.f);
                    continue;
                  }
                  const scalar_t* k_row = k_rows + j * token_stride;
                  typename V::T kt[DV];
                  for (int i = 0; i < DV; ++i) kt[i] = V::load(k_row + V::kLanes * i);
                  for (int g = 0; g < GB; ++g) {
                    typename V::T s = V::mul(qv[g][0], kt[0]);
                    for (int i = 1; i < DV; ++i) s = V::fmadd(qv[g][i], kt[i], s);
                    part[g][j] = s;
                  }
                }
              }
              for (int g = 0; g < GB; ++g) {
                float* scores = p.data() + (g0 + g) * BS + t0;
                if (n == V::kLanes) {
                  V::store(scores, V::sum_lanes(part[g]));
                  continue;
                }
                alignas(64) float sums[V::kLanes];
                V::store(sums, V::sum_lanes(part[g]));
                for (int64_t j = 0; j < n; ++j) scores[j] = sums[j];
              }
            }
          }
          float correction[G];
          for (int g = 0; g < G; ++g)
            correction[g] = softmax_block(p.data() + g * BS, num_tokens, m[h0 + g], l[h0 + g]);
          for (int g0 = 0; g0 < G; g0 += GB) {
            typename V::T a[GB][DV];
            for (int g = 0; g < GB; ++g) {
              const typename V::T c = V::set1(correction[g0 + g]);
              float* acc_g = acc.data() + (h0 + g0 + g) * D;
              for (int i = 0; i < DV; ++i) a[g][i] = V::mul(c, V::load(acc_g + V::kLanes * i));
            }
            for (int64_t t = 0; t < num_tokens; ++t) {
              next.ahead();
              const scalar_t* v_row = v_block + t * token_stride + kv_head * D;
              typename V::T vt[DV];
              for (int i = 0; i < DV; ++i) vt[i] = V::load(v_row + V::kLanes * i);
              for (int g = 0; g < GB; ++g) {
                const typename V::T w = V::set1(p[(g0 + g) * BS + t]);
                for (int i = 0; i < DV; ++i) a[g][i] = V::fmadd(w, vt[i], a[g][i]);
              }
            }
            for (int g = 0; g < GB; ++g)
              for (int i = 0; i < DV; ++i) V::store(acc.data() + (h0 + g0 + g) * D + V::kLanes * i, a[g][i]);
          }
        }
      }
      partials.finish(item, acc, m, l, o + rows[r] * H * D);
    }
  });
  partials.merge(queue, o, rows);
}

// The vector instance for (D, G), or nullptr where none is compiled (then the portable loop).
template <typename scalar_t>
using DecodeFn = void (*)(scalar_t*, const scalar_t*, const scalar_t*, const scalar_t*, const int32_t*,
                          const int32_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float);

template <typename V, typename scalar_t, int DV>
DecodeFn<scalar_t> pick_group(int64_t G) {
  switch (G) {
    case 1: return decode_simd<V, scalar_t, DV, 1>;
    case 2: return decode_simd<V, scalar_t, DV, 2>;
    case 3: return decode_simd<V, scalar_t, DV, 3>;
    case 4: return decode_simd<V, scalar_t, DV, 4>;
    case 5: return decode_simd<V, scalar_t, DV, 5>;
    case 6: return decode_simd<V, scalar_t, DV, 6>;
    case 7: return decode_simd<V, scalar_t, DV, 7>;
    case 8: return decode_simd<V, scalar_t, DV, 8>;
    default: return nullptr;
  }
}

template <typename scalar_t>
DecodeFn<scalar_t> pick_simd(int64_t D, int64_t G) {
#if defined(__AVX512F__)
  using V = Vec16;
#else
  using V = Vec8;
#endif
  if (D == 4 * V::kLanes) return pick_group<V, scalar_t, 4>(G);
  if (D == 8 * V::kLanes) return pick_group<V, scalar_t, 8>(G);
  if (D == 16 * V::kLanes) return pick_group<V, scalar_t, 16>(G);
  return nullptr;
}
#endif

}  // namespace
