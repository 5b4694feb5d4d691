// cpu_decode.cpp's walk over int8 pools on CPUs with AVX-512 BW (Zen 4, Skylake-X and later), for
// D = 64 or 128 (2 or 4 groups of 32); cpu_decode_int8.h's AVX2 walk takes the rest and AVX2-only CPUs.
// QK stays in integers with the int16 query of the AVX2 walk (an int8 query, as VNNI's vpdpbusd
// wants, would cost float32 models their 1e-4 agreement): K rows are widened to int16 once per
// token for the group's G heads, and vpdpwssd (vpmaddwd + add without VNNI) sums 32 products per
// instruction. The widening puts each group in its own 128-bit lanes (D = 64: lanes 0-1 group 0,
// 2-3 group 1; D = 128: lane L group L), so the reduction of 16 tokens' sums (Vec16::sum_lanes's
// tree) is halfway done per lane, in integers, before any scale applies; the (query x K) scales
// multiply there, and the tree's last levels (Vec16::sum_quarters) add the groups in float32. One
// tree per head per 16 tokens, as the bf16 walk. PV in float32 like the AVX2 walk with 16 lanes: a
// V vector is a widening and a conversion, then one FMA per head, its weight p x the V group's
// scale. Scales are gathered 16 tokens at a time (vpgatherdd of the 3 packed bytes and one before).
#pragma once
#include "cpu_decode_int8.h"

#if defined(PAGEDSERVE_DECODE_INT8) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_DECODE_INT8_AVX512 1

namespace {

// The int16 vector c of a K row (NG groups of 32) holds in 128-bit lane L the row's qword
// source_qword(c, L) (8 values), of group lane_group(L).
template <int NG>
constexpr int source_qword(int c, int L) { return NG == 2 ? 4 * (L / 2) + 2 * c + L % 2 : 4 * L + c; }
template <int NG>
constexpr int lane_group(int L) { return NG == 2 ? L / 2 : L; }

template <int NG>
inline void widen_k(const int8_t* row, __m512i* out) {
  if constexpr (NG == 2) {
    const __m512i r = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), _mm512_loadu_si512(row));
    out[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(r));
    out[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(r, 1));
  } else {
    const __m512i a = _mm512_loadu_si512(row), b = _mm512_loadu_si512(row + 64);
    const __m512i r01 = _mm512_permutex2var_epi64(a, _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13), b);
    const __m512i r23 = _mm512_permutex2var_epi64(a, _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15), b);
    out[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(r01));
    out[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(r01, 1));
    out[2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(r23));
    out[3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(r23, 1));
  }
}

inline __m512i dot_pairs(__m512i acc, __m512i a, __m512i b) {  // acc + pairwise int16 products
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Group scales of n <= 16 rows (token_stride apart) into out[g * BP + t], zero past n
template <int NG>
inline void gather_scales(const int8_t* rows, int64_t token_stride, int64_t n, float* out, int64_t BP) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(token_stride)));
  const __m512i bits = _mm512_set1_epi32(0x7FF80000);  // a scale's 12 bits, as float32 bits 19-30
  const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
  for (int pair = 0; pair < NG / 2; ++pair) {  // bytes D + 3 pair - 1 ..: one before the pair's 3
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, rows + 32 * NG + 3 * pair - 1, 1);
    _mm512_storeu_si512(out + 2 * pair * BP, _mm512_and_si512(_mm512_slli_epi32(v, 11), bits));
    _mm512_storeu_si512(out + (2 * pair + 1) * BP, _mm512_and_si512(_mm512_srli_epi32(v, 1), bits));
  }
}

// 16 tokens' int32 lane sums part[t] -> their scores: per 128-bit lane sums (integers), times
// sc[i] (lane (L, j): the scale of token 4i + j's group lane_group(L)), then summed over lanes
inline __m512 scaled_sums(const __m512i* part, const __m512* sc) {
  __m512i x[8];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(part[2 * i], part[2 * i + 1]),
                            _mm512_unpackhi_epi32(part[2 * i], part[2 * i + 1]));
  __m512 y[4];
  for (int i = 0; i < 4; ++i) {
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]),
                                       _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
    y[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(s), sc[i]);
  }
  return Vec16::sum_quarters(y);
}

template <typename scalar_t, int NG, int G>
void decode_int8_avx512(scalar_t* o, const scalar_t* q, const int8_t* k_pool, const int8_t* v_pool,
                        const int32_t* tables, const int32_t* lens, const int64_t* rows, int64_t num_reqs,
                        int64_t q_stride, int64_t Hkv, int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = 32 * NG, C = D / 16;  // C float vectors per row
  const int64_t W = KvRow<int8_t>::width(D), H = Hkv * G;
  const int64_t token_stride = Hkv * W, block_elems = BS * token_stride;
  const int64_t BP = (BS + 15) / 16 * 16;
  WorkQueue queue(lens, num_reqs, BS);
  Partials partials(queue.num_parts(), H, D);
  on_every_thread([&] {
    // qp [H, D] int16 in widen_k's order; qsl [H, 16] lane L: the head's scale of group lane_group(L);
    // ks, vs [NG, BP] the block's scales; kw [16, NG] a chunk's widened K; w [G, NG, BP] p x V scales
    std::vector<int16_t> qi(D), qp(H * D);
    std::vector<float> x(D), qs(NG), qsl(H * 16), acc(H * D), p(G * BP), ks(NG * BP), vs(NG * BP), w(G * NG * BP);
    std::vector<float> m(H), l(H);
    std::vector<__m512i> kw(16 * NG);
    const __m512 no_score = _mm512_set1_ps(kNoScore);
    for (WorkItem item; queue.next(item);) {
      const int64_t r = item.r;
      const scalar_t* q_rows = q + rows[r] * q_stride;
      for (int64_t j = 0; j < H; ++j) {
        for (int64_t d = 0; d < D; ++d) x[d] = widen(q_rows[j * D + d]) * scale;
        quantize_query<NG>(x.data(), qi.data(), qs.data());
        for (int c = 0; c < NG; ++c)
          for (int L = 0; L < 4; ++L) {
            std::copy_n(qi.data() + 8 * source_qword<NG>(c, L), 8, qp.data() + j * D + 32 * c + 8 * L);
            std::fill_n(qsl.data() + j * 16 + 4 * L, 4, qs[lane_group<NG>(L)]);
          }
      }
      reset_item(acc, m, l);
      const int64_t len = lens[r];
      const int32_t* table = tables + r * max_blocks;
      constexpr int64_t PF = 2;  // blocks ahead, prefetched a few lines per token of the PV loop
      for (int64_t b = item.begin; b < std::min(item.begin + PF, item.end); ++b)
        prefetch_block(k_pool + table[b] * block_elems, v_pool + table[b] * block_elems, block_elems);
      for (int64_t b = item.begin; b < item.end; ++b) {
        const int64_t n = std::min(BS, len - b * BS);
        const int8_t *k_rows0 = k_pool + table[b] * block_elems, *v_rows0 = v_pool + table[b] * block_elems;
        const bool pf = b + PF < item.end;
        const char* k_next = pf ? reinterpret_cast<const char*>(k_pool + table[b + PF] * block_elems) : nullptr;
        const char* v_next = pf ? reinterpret_cast<const char*>(v_pool + table[b + PF] * block_elems) : nullptr;
        const int64_t head_bytes = block_elems / Hkv, pf_step = (head_bytes / n + 63) / 64 * 64;
        for (int64_t kv_head = 0; kv_head < Hkv; ++kv_head) {
          const int8_t* k_rows = k_rows0 + kv_head * W;
          const int8_t* v_rows = v_rows0 + kv_head * W;
          const int64_t h0 = kv_head * G, pf_base = kv_head * head_bytes;
          for (int64_t t0 = 0; t0 < n; t0 += 16) {
            gather_scales<NG>(k_rows + t0 * token_stride, token_stride, n - t0, ks.data() + t0, BP);
            gather_scales<NG>(v_rows + t0 * token_stride, token_stride, n - t0, vs.data() + t0, BP);
          }
          for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int64_t nt = std::min<int64_t>(16, n - t0);
            for (int64_t t = 0; t < nt; ++t) widen_k<NG>(k_rows + (t0 + t) * token_stride, kw.data() + t * NG);
            __m512 sc[4];  // lane (L, j): token t0 + 4i + j's K scale of group lane_group(L)
            for (int i = 0; i < 4; ++i) {
              sc[i] = _mm512_castps128_ps512(_mm_loadu_ps(ks.data() + lane_group<NG>(0) * BP + t0 + 4 * i));
              sc[i] = _mm512_insertf32x4(sc[i], _mm_loadu_ps(ks.data() + lane_group<NG>(1) * BP + t0 + 4 * i), 1);
              sc[i] = _mm512_insertf32x4(sc[i], _mm_loadu_ps(ks.data() + lane_group<NG>(2) * BP + t0 + 4 * i), 2);
              sc[i] = _mm512_insertf32x4(sc[i], _mm_loadu_ps(ks.data() + lane_group<NG>(3) * BP + t0 + 4 * i), 3);
            }
            for (int g = 0; g < G; ++g) {
              const int64_t j = h0 + g;
              __m512i qv[NG];
              for (int c = 0; c < NG; ++c) qv[c] = _mm512_loadu_si512(qp.data() + j * D + 32 * c);
              __m512i part[16];
              for (int64_t t = 0; t < 16; ++t) {
                part[t] = _mm512_setzero_si512();
                if (t < nt)
                  for (int c = 0; c < NG; ++c) part[t] = dot_pairs(part[t], qv[c], kw[t * NG + c]);
              }
              const __m512 qsv = _mm512_loadu_ps(qsl.data() + j * 16);
              __m512 scq[4];
              for (int i = 0; i < 4; ++i) scq[i] = _mm512_mul_ps(sc[i], qsv);
              const __m512 s = _mm512_mask_blend_ps(static_cast<__mmask16>((1u << nt) - 1u), no_score,
                                                    scaled_sums(part, scq));
              _mm512_storeu_ps(p.data() + g * BP + t0, s);
            }
          }
          __m512 a[G][C];
          for (int g = 0; g < G; ++g) {
            const __m512 corr = _mm512_set1_ps(softmax_block(p.data() + g * BP, n, m[h0 + g], l[h0 + g]));
            for (int c = 0; c < C; ++c) a[g][c] = _mm512_mul_ps(corr, _mm512_loadu_ps(acc.data() + (h0 + g) * D + 16 * c));
            for (int grp = 0; grp < NG; ++grp)
              for (int64_t t0 = 0; t0 < n; t0 += 16)
                _mm512_storeu_ps(w.data() + (g * NG + grp) * BP + t0,
                                 _mm512_mul_ps(_mm512_loadu_ps(p.data() + g * BP + t0),
                                               _mm512_loadu_ps(vs.data() + grp * BP + t0)));
          }
          for (int64_t t = 0; t < n; ++t) {
            if (pf)
              for (int64_t off = pf_base + t * pf_step; off < std::min(pf_base + (t + 1) * pf_step, pf_base + head_bytes); off += 64) {
                _mm_prefetch(k_next + off, _MM_HINT_T1);
                _mm_prefetch(v_next + off, _MM_HINT_T1);
              }
            const int8_t* v = v_rows + t * token_stride;
            __m512 vf[C];
            for (int c = 0; c < C; ++c)
              vf[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * c))));
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < C; ++c)
                a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[(g * NG + c / 2) * BP + t]), vf[c], a[g][c]);
          }
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc.data() + (h0 + g) * D + 16 * c, a[g][c]);
        }
      }
      partials.finish(item, acc, m, l, o + rows[r] * H * D);
    }
  });
  partials.merge(queue, o, rows);
}

template <typename scalar_t, int NG>
DecodeInt8Fn<scalar_t> pick_int8_avx512_group(int64_t G) {
  return pick_constant<DecodeInt8Fn<scalar_t>>(
      G, [](auto g) -> DecodeInt8Fn<scalar_t> { return decode_int8_avx512<scalar_t, NG, decltype(g)::value>; },
      std::make_integer_sequence<int, 8>{});
}

// The instance for (D, G), or nullptr (then cpu_decode_int8.h's walk).
template <typename scalar_t>
DecodeInt8Fn<scalar_t> pick_int8_avx512(int64_t D, int64_t G) {
  if (D == 64) return pick_int8_avx512_group<scalar_t, 2>(G);
  if (D == 128) return pick_int8_avx512_group<scalar_t, 4>(G);
  return nullptr;
}

}  // namespace
#endif
