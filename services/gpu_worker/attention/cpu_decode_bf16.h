// cpu_decode.cpp's walk over bf16 pools on CPUs with AVX-512 BF16, D = 32 * DW, block_size a
// multiple of 16. A request's blocks are walked in order, per KV head 16 tokens at a time (a chunk):
// QK with vdpbf16ps on the stored query and K rows (scores_lane_heads or scores_per_head); the
// chunk's online-softmax update in registers; then PV with vdpbf16ps too, two tokens per
// instruction: the weights rounded to bf16 (as torch's CPU flash attention does for bf16) and two V
// rows interleaved by vpunpck{l,h}wd, so the accumulators hold the output in that interleaved order
// (unpermuted once per request). The block kAhead on is prefetched into L2 two rows per PV step (a
// burst per chunk stalls on the miss queue).
#pragma once
#include "cpu_decode_simd.h"

#if defined(__AVX512BF16__)
namespace {

// exp(x) for x <= 0, 16 lanes: Cephes' expf polynomial on x - n ln2, scaled by 2^n
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t kAhead = 2;  // blocks between the one computed and the one prefetched

// lane L, dword u = the sum of a[u]'s four dwords in lane L (a 4 x 4 transpose-add per 128-bit lane)
inline __m512 sum_quads(const __m512* a) {
  const __m512 x0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 x1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d y0 = _mm512_castps_pd(x0), y1 = _mm512_castps_pd(x1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(y0, y1)), _mm512_castpd_ps(_mm512_unpackhi_pd(y0, y1)));
}

// G <= 4 heads in the 128-bit lanes of a vector: the query rows as D / 8 vectors, vector c's lane
// L holding head L's elements [8c, 8c + 8) (zero past G), into lanes[D / 8 * 32]
template <int DW, int G>
inline void lane_heads(const c10::BFloat16* q, c10::BFloat16* lanes) {
  constexpr int64_t D = 32 * DW;
  for (int64_t c = 0; c < D / 8; ++c)
    for (int L = 0; L < 4; ++L)
      for (int e = 0; e < 8; ++e) lanes[c * 32 + 8 * L + e] = L < G ? q[L * D + 8 * c + e] : c10::BFloat16(0.f);
}

// Scores of n <= 16 tokens for G <= 4 heads: each K piece of 8 elements broadcast to the four
// lanes meets every head's piece in one vdpbf16ps (D / 8 per token), and four tokens' sums finish
// by sum_quads; s[g] lane t = token t's score for head g
template <int DW, int G>
inline void scores_lane_heads(const c10::BFloat16* k, int64_t n, int64_t stride, const c10::BFloat16* lanes,
                              __m512* s) {
  constexpr int64_t NC = 4 * DW, TB = DW == 2 ? 16 : 8;  // K pieces per row; tokens per register batch
  __m512 r[4];
  for (int64_t t0 = 0; t0 < 16; t0 += TB) {
    __m512 a[TB];
    for (int64_t t = 0; t < TB; ++t) a[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < NC; ++c) {
      const __m512bh qc = (__m512bh)_mm512_loadu_si512(lanes + 32 * c);
#pragma GCC unroll 16
      for (int64_t t = 0; t < TB; ++t) {
        if (t0 + t >= n) break;
        const __m128i piece = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + (t0 + t) * stride + 8 * c));
        a[t] = _mm512_dpbf16_ps(a[t], qc, (__m512bh)_mm512_broadcast_i32x4(piece));
      }
    }
    for (int64_t u = 0; u < TB / 4; ++u) r[t0 / 4 + u] = sum_quads(a + 4 * u);
  }
  const __m512 lo01 = _mm512_shuffle_f32x4(r[0], r[1], 0x44), lo23 = _mm512_shuffle_f32x4(r[2], r[3], 0x44);
  const __m512 hi01 = _mm512_shuffle_f32x4(r[0], r[1], 0xEE), hi23 = _mm512_shuffle_f32x4(r[2], r[3], 0xEE);
  const __m512 heads[4] = {_mm512_shuffle_f32x4(lo01, lo23, 0x88), _mm512_shuffle_f32x4(lo01, lo23, 0xDD),
                           _mm512_shuffle_f32x4(hi01, hi23, 0x88), _mm512_shuffle_f32x4(hi01, hi23, 0xDD)};
  for (int g = 0; g < G; ++g) s[g] = heads[g];
}

// Scores of n <= 16 tokens, head by head: DW vdpbf16ps per token and head, 16 tokens' sums
// reduced together by Vec16::sum_lanes
template <int DW, int G>
inline void scores_per_head(const c10::BFloat16* k, int64_t n, int64_t stride, const c10::BFloat16* q, __m512* s) {
  constexpr int64_t D = 32 * DW;
  for (int g = 0; g < G; ++g) {
    __m512bh qw[DW];
    for (int w = 0; w < DW; ++w) qw[w] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * w);
    __m512 part[16];
#pragma GCC unroll 16
    for (int64_t t = 0; t < 16; ++t) {
      part[t] = _mm512_setzero_ps();
      if (t >= n) continue;
      for (int w = 0; w < DW; ++w)
        part[t] = _mm512_dpbf16_ps(part[t], qw[w], (__m512bh)_mm512_loadu_si512(k + t * stride + 32 * w));
    }
    s[g] = Vec16::sum_lanes(part);
  }
}

template <int G>
constexpr bool kLaneHeads = G == 3 || G == 4;  // at most one lane of four idle

// One chunk of n <= 16 tokens (rows `stride` apart from k and v) for the G heads of a KV head:
// q their query rows (lane_heads' layout where kLaneHeads), acc [G, D] interleaved, m and l [G];
// k_ahead/v_ahead the same rows kAhead blocks on (nullptr: none).
template <int DW, int G>
inline void decode_chunk(const c10::BFloat16* k, const c10::BFloat16* v, const c10::BFloat16* k_ahead,
                         const c10::BFloat16* v_ahead, int64_t n, int64_t stride, const c10::BFloat16* q,
                         float scale, float* acc, float* m, float* l) {
  constexpr int64_t D = 32 * DW;
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  __m512 s[G];
  if constexpr (kLaneHeads<G>) scores_lane_heads<DW, G>(k, n, stride, q, s);
  else scores_per_head<DW, G>(k, n, stride, q, s);
  alignas(64) uint32_t weights[G][8];  // per head the chunk's bf16 weights, token pairs
  float correction[G];
  for (int g = 0; g < G; ++g) {
    const __m512 sg = _mm512_mul_ps(s[g], _mm512_set1_ps(scale));
    const float new_m = std::max(m[g], _mm512_mask_reduce_max_ps(valid, sg));
    const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(sg, _mm512_set1_ps(new_m))));
    correction[g] = std::exp(m[g] - new_m);
    l[g] = l[g] * correction[g] + _mm512_reduce_add_ps(e);
    m[g] = new_m;
    _mm256_store_si256(reinterpret_cast<__m256i*>(weights[g]), (__m256i)_mm512_cvtneps_pbh(e));
  }
  __m512 a[G][2 * DW];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * DW; ++i)
      a[g][i] = _mm512_mul_ps(_mm512_set1_ps(correction[g]), _mm512_loadu_ps(acc + g * D + 16 * i));
  for (int64_t pair = 0; 2 * pair < n; ++pair) {
    const c10::BFloat16* row = v + 2 * pair * stride;
    const bool second = 2 * pair + 1 < n;
    if (k_ahead != nullptr)  // a full chunk: its two rows kAhead blocks on
      for (int64_t x = 2 * pair * stride; x < (2 * pair + 2) * stride; x += stride)
        for (int w = 0; w < DW; ++w) {
          _mm_prefetch(reinterpret_cast<const char*>(k_ahead + x + 32 * w), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(v_ahead + x + 32 * w), _MM_HINT_T1);
        }
    __m512i vp[2 * DW];
    for (int w = 0; w < DW; ++w) {
      const __m512i x0 = _mm512_loadu_si512(row + 32 * w);
      const __m512i x1 = second ? _mm512_loadu_si512(row + stride + 32 * w) : _mm512_setzero_si512();
      vp[2 * w] = _mm512_unpacklo_epi16(x0, x1);
      vp[2 * w + 1] = _mm512_unpackhi_epi16(x0, x1);
    }
    for (int g = 0; g < G; ++g) {
      const __m512bh wt = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[g][pair]));
      for (int i = 0; i < 2 * DW; ++i) a[g][i] = _mm512_dpbf16_ps(a[g][i], (__m512bh)vp[i], wt);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * DW; ++i) _mm512_storeu_ps(acc + g * D + 16 * i, a[g][i]);
}

// out[d] = acc[d] * inv in natural order: acc vector 2w + h, lane 4c + j holds element 32w + 8c + 4h + j
template <int DW, typename T>
inline void unpermute(const float* acc, float inv, T* out) {
  for (int w = 0; w < DW; ++w)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) out[32 * w + 8 * c + 4 * h + j] = narrow<T>(acc[(2 * w + h) * 16 + 4 * c + j] * inv);
}

template <int DW, int G>
void decode_avx512_bf16(c10::BFloat16* o, const c10::BFloat16* q, const c10::BFloat16* k_pool,
                        const c10::BFloat16* v_pool, const int32_t* tables, const int32_t* lens, const int64_t* rows,
                        int64_t num_reqs, int64_t q_stride, int64_t Hkv, int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = 32 * DW;
  const int64_t H = Hkv * G, token_stride = Hkv * D, block_elems = BS * token_stride;
  WorkQueue queue(lens, num_reqs, BS);
  Partials partials(queue.num_parts(), H, D);
  on_every_thread([&] {
    std::vector<float> acc(H * D), m(H), l(H);
    std::vector<c10::BFloat16> lanes(kLaneHeads<G> ? Hkv * D * 4 : 0);  // per KV head, lane_heads' layout
    for (WorkItem item; queue.next(item);) {
      const int64_t r = item.r, len = lens[r];
      const c10::BFloat16* q_rows = q + rows[r] * q_stride;
      if constexpr (kLaneHeads<G>)
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head)
          lane_heads<DW, G>(q_rows + kv_head * G * D, lanes.data() + kv_head * D * 4);
      const int32_t* table = tables + r * max_blocks;
      reset_item(acc, m, l);
      for (int64_t b = item.begin; b < std::min(item.begin + kAhead, item.end); ++b)
        prefetch_block(k_pool + table[b] * block_elems, v_pool + table[b] * block_elems, block_elems * 2);
      for (int64_t b = item.begin; b < item.end; ++b) {
        const int64_t block_tokens = std::min(BS, len - b * BS);
        const bool ahead = b + kAhead < item.end;
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head)
          for (int64_t t0 = 0; t0 < block_tokens; t0 += 16) {
            const int64_t at = table[b] * block_elems + t0 * token_stride + kv_head * D;
            const int64_t at_ahead = ahead ? table[b + kAhead] * block_elems + t0 * token_stride + kv_head * D : 0;
            decode_chunk<DW, G>(k_pool + at, v_pool + at, ahead ? k_pool + at_ahead : nullptr, v_pool + at_ahead,
                                std::min<int64_t>(16, block_tokens - t0), token_stride,
                                kLaneHeads<G> ? lanes.data() + kv_head * D * 4 : q_rows + kv_head * G * D,
                                scale, acc.data() + kv_head * G * D, m.data() + kv_head * G, l.data() + kv_head * G);
          }
      }
      if (item.part >= 0) {  // the slice's acc in natural order
        for (int64_t j = 0; j < H; ++j) unpermute<DW>(acc.data() + j * D, 1.f, partials.acc(item.part) + j * D);
        partials.store_ml(item.part, m, l);
        continue;
      }
      c10::BFloat16* out_rows = o + rows[r] * H * D;
      for (int64_t j = 0; j < H; ++j) unpermute<DW>(acc.data() + j * D, len > 0 ? 1.f / l[j] : 0.f, out_rows + j * D);
    }
  });
  partials.merge(queue, o, rows);
}

using DecodeBf16Fn = void (*)(c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                              const int32_t*, const int32_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                              int64_t, float);

template <int DW>
DecodeBf16Fn pick_bf16_group(int64_t G) {
  switch (G) {
    case 1: return decode_avx512_bf16<DW, 1>;
    case 2: return decode_avx512_bf16<DW, 2>;
    case 3: return decode_avx512_bf16<DW, 3>;
    case 4: return decode_avx512_bf16<DW, 4>;
    case 5: return decode_avx512_bf16<DW, 5>;
    case 6: return decode_avx512_bf16<DW, 6>;
    case 7: return decode_avx512_bf16<DW, 7>;
    case 8: return decode_avx512_bf16<DW, 8>;
    default: return nullptr;
  }
}

inline DecodeBf16Fn pick_avx512_bf16(int64_t D, int64_t G, int64_t BS) {
  if (BS % 16 != 0) return nullptr;
  if (D == 64) return pick_bf16_group<2>(G);
  if (D == 128) return pick_bf16_group<4>(G);
  return nullptr;
}

}  // namespace
#endif
