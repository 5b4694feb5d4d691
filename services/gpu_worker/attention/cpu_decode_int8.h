// cpu_decode.cpp's walk over int8 pools (kv_quant.py's rows, D = 32 * NG: groups of 32) on any CPU
// with AVX2 + FMA (on AVX-512 ones, cpu_decode_int8_avx512.h's walk where D allows). QK in
// integers: each query row is quantized once per request to int16 with one scale per group of 32
// (2^-16 of the group's max|q|, far below the int8 K's step), K rows are sign-extended to int16,
// and vpmaddwd sums 16 products per instruction; a group's 8 tokens' sums are reduced together,
// converted once and scaled by (query scale x K scale). PV in float32: p x the V group's scale is
// one weight per (token, head, group), so a V vector costs a widening and one FMA per head, no multiply.
#pragma once
#include "cpu_decode_work.h"
#include "cpu_decode_simd.h"

#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_DECODE_INT8 1

namespace {

// lane j = the sum of v[j]'s 8 int32 lanes (Vec8::sum_lanes in integers)
inline __m256i sum_lanes_epi32(const __m256i* v) {
  const __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline __m256i widen16(const int8_t* p) {  // 16 int8 -> 16 int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 widen8f(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A query row x [D] -> qi [D] int16 and qs [NG] group scales: x ~ qi * qs.
template <int NG>
inline void quantize_query(const float* x, int16_t* qi, float* qs) {
  for (int grp = 0; grp < NG; ++grp) {
    float amax = 0.f;
    for (int d = 32 * grp; d < 32 * grp + 32; ++d) amax = std::max(amax, std::abs(x[d]));
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    for (int d = 32 * grp; d < 32 * grp + 32; ++d) qi[d] = static_cast<int16_t>(std::lrintf(x[d] * inv));
    qs[grp] = amax / 32767.f;
  }
}

// NG groups of 32 per row, G query heads per KV head; BS any (tokens taken 8 at a time, padded).
template <typename scalar_t, int NG, int G>
void decode_int8(scalar_t* o, const scalar_t* q, const int8_t* k_pool, const int8_t* v_pool, const int32_t* tables,
                 const int32_t* lens, const int64_t* rows, int64_t num_reqs, int64_t q_stride, int64_t Hkv, int64_t BS,
                 int64_t max_blocks, float scale) {
  constexpr int64_t D = 32 * NG;
  constexpr int HB = G <= 4 ? G : 4;  // heads per PV pass: 2 * HB accumulators + 3 in 16 registers
  const int64_t W = KvRow<int8_t>::width(D), H = Hkv * G;
  const int64_t token_stride = Hkv * W, block_elems = BS * token_stride;
  const int64_t BP = (BS + 7) / 8 * 8;  // BS padded to whole 8-token steps
  WorkQueue queue(lens, num_reqs, BS);
  Partials partials(queue.num_parts(), H, D);
  on_every_thread([&] {
    // qi [H, D], qs [H, NG]; ks [NG, BP] the block's K scales; w [G, NG, BP] p x V scales
    std::vector<int16_t> qi(H * D);
    std::vector<float> x(D), qs(H * NG), acc(H * D), p(G * BP), ks(NG * BP), w(G * NG * BP), m(H), l(H);
    for (WorkItem item; queue.next(item);) {
      const int64_t r = item.r;
      const scalar_t* q_rows = q + rows[r] * q_stride;
      for (int64_t j = 0; j < H; ++j) {
        for (int64_t d = 0; d < D; ++d) x[d] = widen(q_rows[j * D + d]) * scale;
        quantize_query<NG>(x.data(), qi.data() + j * D, qs.data() + j * NG);
      }
      reset_item(acc, m, l);
      const int64_t len = lens[r];
      const int32_t* table = tables + r * max_blocks;
      for (int64_t b = item.begin; b < item.end; ++b) {
        if (b + 1 < item.end)
          prefetch_block(k_pool + table[b + 1] * block_elems, v_pool + table[b + 1] * block_elems, block_elems);
        const int64_t n = std::min(BS, len - b * BS);
        const int8_t *k_rows0 = k_pool + table[b] * block_elems, *v_rows0 = v_pool + table[b] * block_elems;
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head) {
          const int8_t* k_rows = k_rows0 + kv_head * W;
          const int8_t* v_rows = v_rows0 + kv_head * W;
          for (int64_t t = 0; t < n; ++t)
            for (int grp = 0; grp < NG; ++grp) ks[grp * BP + t] = KvRow<int8_t>::scale(k_rows + t * token_stride, D, grp);
          for (int g = 0; g < G; ++g) {
            const int64_t j = kv_head * G + g;
            const int16_t* qg = qi.data() + j * D;
            for (int64_t t0 = 0; t0 < n; t0 += 8) {
              __m256 s = _mm256_setzero_ps();
              for (int grp = 0; grp < NG; ++grp) {
                const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * grp));
                const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * grp + 16));
                __m256i part[8];
                for (int64_t i = 0; i < 8; ++i) {
                  if (t0 + i >= n) {
                    part[i] = _mm256_setzero_si256();
                    continue;
                  }
                  const int8_t* k = k_rows + (t0 + i) * token_stride + 32 * grp;
                  part[i] = _mm256_add_epi32(_mm256_madd_epi16(q0, widen16(k)), _mm256_madd_epi16(q1, widen16(k + 16)));
                }
                const __m256 kq = _mm256_mul_ps(_mm256_loadu_ps(ks.data() + grp * BP + t0), _mm256_set1_ps(qs[j * NG + grp]));
                s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes_epi32(part)), kq, s);
              }
              _mm256_storeu_ps(p.data() + g * BP + t0, s);
            }
          }
          for (int g = 0; g < G; ++g) {
            const int64_t j = kv_head * G + g;
            const float correction = softmax_block(p.data() + g * BP, n, m[j], l[j]);
            for (int64_t d = 0; d < D; ++d) acc[j * D + d] *= correction;
          }
          for (int64_t t = 0; t < n; ++t)
            for (int grp = 0; grp < NG; ++grp) {
              const float vs = KvRow<int8_t>::scale(v_rows + t * token_stride, D, grp);
              for (int g = 0; g < G; ++g) w[(g * NG + grp) * BP + t] = p[g * BP + t] * vs;
            }
          for (int64_t c = 0; c < D / 16; ++c) {  // 16 columns at a time, in group c / 2
            const int grp = static_cast<int>(c / 2);
            for (int g0 = 0; g0 < G; g0 += HB) {
              __m256 a[HB][2];
              for (int g = 0; g < HB && g0 + g < G; ++g) {
                float* acc_g = acc.data() + ((kv_head * G + g0 + g) * D + 16 * c);
                a[g][0] = _mm256_loadu_ps(acc_g);
                a[g][1] = _mm256_loadu_ps(acc_g + 8);
              }
              for (int64_t t = 0; t < n; ++t) {
                const int8_t* v = v_rows + t * token_stride + 16 * c;
                const __m256 v0 = widen8f(v), v1 = widen8f(v + 8);
                for (int g = 0; g < HB && g0 + g < G; ++g) {
                  const __m256 wt = _mm256_set1_ps(w[((g0 + g) * NG + grp) * BP + t]);
                  a[g][0] = _mm256_fmadd_ps(wt, v0, a[g][0]);
                  a[g][1] = _mm256_fmadd_ps(wt, v1, a[g][1]);
                }
              }
              for (int g = 0; g < HB && g0 + g < G; ++g) {
                float* acc_g = acc.data() + ((kv_head * G + g0 + g) * D + 16 * c);
                _mm256_storeu_ps(acc_g, a[g][0]);
                _mm256_storeu_ps(acc_g + 8, a[g][1]);
              }
            }
          }
        }
      }
      partials.finish(item, acc, m, l, o + rows[r] * H * D);
    }
  });
  partials.merge(queue, o, rows);
}

template <typename scalar_t>
using DecodeInt8Fn = void (*)(scalar_t*, const scalar_t*, const int8_t*, const int8_t*, const int32_t*,
                              const int32_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float);

// make(std::integral_constant<int, G>{}) for the G in 1..8 that equals g, else nullptr
template <typename Fn, typename Make, int... Gs>
Fn pick_constant(int64_t g, Make make, std::integer_sequence<int, Gs...>) {
  Fn fn = nullptr;
  ((g == Gs + 1 ? (fn = make(std::integral_constant<int, Gs + 1>{}), 0) : 0), ...);
  return fn;
}

template <typename scalar_t, int NG>
DecodeInt8Fn<scalar_t> pick_int8_group(int64_t G) {
  return pick_constant<DecodeInt8Fn<scalar_t>>(
      G, [](auto g) -> DecodeInt8Fn<scalar_t> { return decode_int8<scalar_t, NG, decltype(g)::value>; },
      std::make_integer_sequence<int, 8>{});
}

// The instance for (D, G), or nullptr (then the portable loop).
template <typename scalar_t>
DecodeInt8Fn<scalar_t> pick_int8(int64_t D, int64_t G) {
  switch (D) {
    case 32: return pick_int8_group<scalar_t, 1>(G);
    case 64: return pick_int8_group<scalar_t, 2>(G);
    case 96: return pick_int8_group<scalar_t, 3>(G);
    case 128: return pick_int8_group<scalar_t, 4>(G);
    case 256: return pick_int8_group<scalar_t, 8>(G);
    default: return nullptr;
  }
}

}  // namespace
#endif
