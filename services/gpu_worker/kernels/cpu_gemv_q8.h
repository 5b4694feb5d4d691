// The Q8_0 few-row loops of cpu_gemv.cpp (its tile/kBlocksPerTile conventions; included inside its
// AVX-512 BF16 section).
#pragma once

// ---- Q8_0 weights (GGUF): w[n, k] = d[n, k/32] * q[n, k], q in -128..127 ----------------
// q in pairs layout [N/16, K/2, 16, 2] int8 (linear.q8_pairs) and d [N/16, K/32, 16] fp16
// (gguf_blocks.pack_q8_0). q is exact in bf16: 32 bytes widen to one pairs step (16 outputs, 2 k)
// by two vpmovsxbd, two vcvtdq2ps and one vcvtne2ps2bf16, and vdpbf16ps adds the exact products
// in float32, k in order, whatever the row count; per 32-k group and output y += d * sum, rounded
// to bf16 once. The weights are the GGUF's exact values (1.0625 bytes a weight instead of 2).
template <int M, int NB>
inline void tile_q8(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride,
                    int64_t num_groups, const int8_t* qs, const uint16_t* ds, int64_t K2, int64_t b0) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 part[M][NB];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) part[m][b] = _mm512_setzero_ps();
    for (int64_t j = 16 * g; j < 16 * g + 16; ++j) {
      __m512bh wv[NB];
      for (int b = 0; b < NB; ++b) {
        const int8_t* p = qs + ((b0 + b) * K2 + j) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
        wv[b] = _mm512_cvtne2ps_pbh(hi, lo);  // bf16 0..15 from lo, 16..31 from hi: the 32 bytes' order
      }
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + j]));
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_dpbf16_ps(part[m][b], xv, wv[b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 d = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + ((b0 + b) * num_groups + g) * 16)));
      for (int m = 0; m < M; ++m) acc[m][b] = _mm512_fmadd_ps(d, part[m][b], acc[m][b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + (b0 + b) * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
}

template <int M>
void rows_q8(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride, const int8_t* qs,
             const uint16_t* ds, int64_t K2, int64_t num_blocks) {
  constexpr int NB = kBlocksPerTile<M>;
  const int64_t num_groups = K2 / 16;
  over_tiles<NB>(num_blocks, K2 * 2,
      [&](int64_t b0) { tile_q8<M, NB>(out, out_stride, x, x_stride, num_groups, qs, ds, K2, b0); },
      [&](int64_t b) { tile_q8<M, 1>(out, out_stride, x, x_stride, num_groups, qs, ds, K2, b); });
}
