// Float32 tiles of many rows, shared by cpu_gemv_f32.cpp (linear_many: the logits) and
// cpu_head_argmax.cpp (argmax_many: a greedy head's tokens without them). Per 16-output block and
// chunk of kChunk k: w [kChunk, 16] floats (d * q (+ m), the GGUF's values, dequantized into a
// thread's scratch; or a packed float32 weight [N/16, K, 16] read in place), then an R x 16
// register tile (2R accumulators, R <= 6: 12 + 2 weights + 1 broadcast of AVX2's 16 registers)
// per R rows. Sums in k order per output: an output's bits depend neither on the rows beside it
// nor on which of the two kernels computed it. cpu_extensions hashes this file (HEADERS).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_F32_TILES 1
#endif

namespace {

#if defined(PAGEDSERVE_F32_TILES)
constexpr int64_t kChunk = 256;

struct DequantQ4 {  // nibbles [N/16, K/2, 16], dm [N/16, K/32, 2, 16]
  const uint8_t* nib;
  const uint16_t* dm;
  int64_t K;
  const float* operator()(float* w, int64_t b, int64_t k0, int64_t len) const {
    const __m256i low_nibble = _mm256_set1_epi32(0xF);
    const int64_t K2 = K / 2, num_groups = K / 32;
    for (int64_t g = k0 / 32; g < (k0 + len) / 32; ++g) {
      const uint16_t* dmb = dm + (b * num_groups + g) * 32;
      __m256 d[2], mn[2];
      for (int h = 0; h < 2; ++h) {
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmb + 8 * h)));
        mn[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmb + 16 + 8 * h)));
      }
      for (int64_t j = 16 * g; j < 16 * g + 16; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + (b * K2 + j) * 16));
        float* row = w + (2 * j - k0) * 16;
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(bytes, bytes) : bytes);
          const __m256 qe = _mm256_cvtepi32_ps(_mm256_and_si256(v, low_nibble));
          const __m256 qo = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(row + 8 * h, _mm256_add_ps(_mm256_mul_ps(d[h], qe), mn[h]));
          _mm256_storeu_ps(row + 16 + 8 * h, _mm256_add_ps(_mm256_mul_ps(d[h], qo), mn[h]));
        }
      }
    }
    return w;
  }
};

struct DequantQ8 {  // q [N/16, K, 16], d [N/16, K/32, 16]
  const int8_t* qs;
  const uint16_t* ds;
  int64_t K;
  const float* operator()(float* w, int64_t b, int64_t k0, int64_t len) const {
    const int64_t num_groups = K / 32;
    for (int64_t g = k0 / 32; g < (k0 + len) / 32; ++g) {
      __m256 d[2];
      for (int h = 0; h < 2; ++h)
        d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + (b * num_groups + g) * 16 + 8 * h)));
      for (int64_t k = 32 * g; k < 32 * g + 32; ++k) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (b * K + k) * 16));
        float* row = w + (k - k0) * 16;
        _mm256_storeu_ps(row, _mm256_mul_ps(d[0], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
        _mm256_storeu_ps(row + 8, _mm256_mul_ps(d[1], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)))));
      }
    }
    return w;
  }
};

struct PackedF32 {  // w [N/16, K, 16] float32: read in place
  const float* w;
  int64_t K;
  const float* operator()(float*, int64_t b, int64_t k0, int64_t) const { return w + (b * K + k0) * 16; }
};

// out[r, 0..16) (+)= x[r, k0..k0+len) @ w, rows r0..r0+R (out: the block's first column); first: from zero
template <int R>
inline void rows_tile(float* out, int64_t os, const float* x, int64_t xs, const float* w, int64_t k0, int64_t len,
                      int64_t r0, bool first) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (r0 + r) * os + 8 * h);
  for (int64_t k = 0; k < len; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + 16 * k), w1 = _mm256_loadu_ps(w + 16 * k + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + (r0 + r) * xs + k0 + k);
      acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (r0 + r) * os + 8 * h, acc[r][h]);
}

// out[0..M, 0..16) = x [M, K] @ block b's weights^T; wbuf: a thread's [kChunk, 16] scratch
template <typename Dequant>
inline void block_rows(float* out, int64_t os, const float* x, int64_t xs, int64_t M, int64_t K, int64_t b,
                       const Dequant& dequant, float* wbuf) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t len = std::min(kChunk, K - k0);
    const float* w = dequant(wbuf, b, k0, len);
    int64_t r0 = 0;
    for (; r0 + 6 <= M; r0 += 6) rows_tile<6>(out, os, x, xs, w, k0, len, r0, k0 == 0);
    switch (M - r0) {
      case 5: rows_tile<5>(out, os, x, xs, w, k0, len, r0, k0 == 0); break;
      case 4: rows_tile<4>(out, os, x, xs, w, k0, len, r0, k0 == 0); break;
      case 3: rows_tile<3>(out, os, x, xs, w, k0, len, r0, k0 == 0); break;
      case 2: rows_tile<2>(out, os, x, xs, w, k0, len, r0, k0 == 0); break;
      case 1: rows_tile<1>(out, os, x, xs, w, k0, len, r0, k0 == 0); break;
      default: break;
    }
  }
}
#endif

}  // namespace
