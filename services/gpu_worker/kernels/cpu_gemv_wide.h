// Decode batches on AVX-512 BF16 without AMX (cpu_gemv.cpp): out [M, N] = x [M, K] @ W^T for 9 to
// kWideMaxRows bf16 rows. oneDNN reads a bf16 weight (2 bytes a weight) for such steps; here each pair
// of 16-output blocks is read once (bf16 pairs layout in place, or Q4_1 widened in L2 to bf16(d q + m):
// 0.625 bytes a weight) and serves every row, kWideTileRows rows at a time: 24 float32 accumulators,
// one vdpbf16ps per row, block and k pair. Numerics: exact products summed in float32 in k order, pairs
// added together, as linear() sums them; a row's result does not depend on the rows beside it.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t kWideMaxRows = 64;  // past 64 rows oneDNN's bf16 GEMM is as fast on a Zen 4
constexpr int kWideTileRows = 12;      // 12 rows x 2 blocks: 24 accumulators, 2 weights, 1 broadcast

// f(std::integral_constant<int, n>) for n in 1..N
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// out[m, 16 b .. 16 b + 16) for M rows and NB pairs-layout blocks w[b] (K2 * 32 bf16 each)
template <int M, int NB>
inline void wide_tile(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride,
                      const c10::BFloat16* const* w, int64_t K2) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w[b] + k2 * 32);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + k2]));
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + b * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
}

template <int NB>
inline void wide_rows(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride, int64_t M,
                      const c10::BFloat16* const* w, int64_t K2) {
  // tiles of near-equal rows (16: 8 + 8, not 12 + 4): a short tile has too few chains for the latency
  const int64_t num_tiles = (M + kWideTileRows - 1) / kWideTileRows;
  for (int64_t t = 0, r = 0; t < num_tiles; ++t) {
    const int64_t rows_here = M / num_tiles + (t < M % num_tiles);
    with_rows<kWideTileRows>(rows_here, [&](auto rows) {
      wide_tile<decltype(rows)::value, NB>(out + r * out_stride, out_stride, x + r * x_stride, x_stride, w, K2);
    });
    r += rows_here;
  }
}

// a thread's room for two blocks' bf16 (scratch elements each), from a 64-byte boundary
struct PairScratch {
  std::vector<c10::BFloat16> buffer;
  c10::BFloat16* data;
  explicit PairScratch(int64_t scratch)
      : buffer(2 * scratch + 32), data(buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) % 64) / 2) {}
};

// every block pair of the weight, in parallel; widen(b, buffer) gives block b's pairs-layout bf16
// (buffer: PairScratch room of this thread's)
template <typename Widen>
inline void wide_pairs(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride, int64_t M,
                       int64_t K2, int64_t num_blocks, int64_t scratch, const Widen& widen) {
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  const int64_t num_pairs = (num_blocks + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, 512 / std::max<int64_t>(1, K2 * ((M + 15) / 16)));
  at::parallel_for(0, num_pairs, grain, [&](int64_t begin, int64_t end) {
    PairScratch room(scratch);
    c10::BFloat16* scratch_bf16 = room.data;
    for (int64_t p = begin; p < end; ++p) {
      const c10::BFloat16* w[2] = {widen(2 * p, scratch_bf16), nullptr};
      c10::BFloat16* o = out + 32 * p;
      if (2 * p + 1 < num_blocks) {
        w[1] = widen(2 * p + 1, scratch_bf16 + scratch);
        wide_rows<2>(o, out_stride, xp, x_stride / 2, M, w, K2);
      } else {
        wide_rows<1>(o, out_stride, xp, x_stride / 2, M, w, K2);
      }
    }
  });
}

// Q4_1 weights as row pairs (linear.py's amx_nibbles): nib [N/16, K/4, 32], byte j of pair s holding pairs
// row 2s's slot j in its low nibble and row 2s+1's in its high one (slot j: output j / 2, k parity j % 2); dm
// [N/16, K/32, 2, 16] fp16 (cpu_gemv.cpp's). A block widens to bf16(d q + m) as dequantize() computes it:
// d q is exact in float32 (11 + 4 significant bits), so one fma rounds where its mul and add would.
inline void widen_q4(c10::BFloat16* dst, const uint8_t* nib, const uint16_t* dm, int64_t num_groups) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  for (int64_t g = 0; g < num_groups; ++g) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
    const __m512 d_lo = _mm512_permutexvar_ps(lo_idx, d), d_hi = _mm512_permutexvar_ps(hi_idx, d);
    const __m512 m_lo = _mm512_permutexvar_ps(lo_idx, mn), m_hi = _mm512_permutexvar_ps(hi_idx, mn);
    const uint8_t* src = nib + g * 256;  // 8 row pairs of 32 bytes
    c10::BFloat16* rows = dst + g * 512;  // 16 pairs rows of 32 bf16
    for (int r = 0; r < 16; r += 2) {
      const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * 16)));
      const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + r * 16 + 16)));
      for (int h = 0; h < 2; ++h) {  // h 0: the low nibbles (row r), 1: the high ones (row r + 1)
        const __m512i q0 = h ? _mm512_srli_epi32(v0, 4) : _mm512_and_si512(v0, low_nibble);
        const __m512i q1 = h ? _mm512_srli_epi32(v1, 4) : _mm512_and_si512(v1, low_nibble);
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d_lo, m_lo);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d_hi, m_hi);
        _mm512_store_si512(rows + (r + h) * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
      }
    }
  }
}

// widen(b, buffer) of wide_pairs and amx_pairs for Q4_1 row pairs [N/16, K/4, 32] and dm [N/16, K/32, 2, 16]
inline auto q4_widener(const uint8_t* nib, const uint16_t* dm, int64_t K2) {
  return [=](int64_t b, c10::BFloat16* buffer) {
    widen_q4(buffer, nib + b * K2 * 16, dm + b * (K2 / 16) * 32, K2 / 16);
    return buffer;
  };
}
#endif

}  // namespace
