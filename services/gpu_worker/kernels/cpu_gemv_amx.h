// AMX tiles for cpu_gemv.cpp: out [M, N] = x [M, K] @ W^T for 2 to kAmxMaxRows bf16 rows (verify
// steps, decode batches), reading each weight tile once for all rows. The AVX-512 loops issue one
// vdpbf16ps per row and 32 weights, so their cost grows with M; one tdpbf16ps takes [16, 32] x [32, 16].
//
// A tile: x[r .. r+16, 32t .. 32t+32] (rows of 64 bytes, read in place; past 16 rows M is padded to a
// multiple of 16). B tile: 16 outputs' weights for those 32 k in pairs layout (16 rows k2 of [16
// outputs][2] bf16): the packed bf16 weight itself, or a Q4_1 block widened in L2 to bf16(d q + m),
// the very values gguf_blocks.dequantize(...).to(bf16) gives oneDNN. C tile: [16, 16] float32 summed
// over all of K. Numerics: exact products summed in float32 in the tile unit's order, not vdpbf16ps's:
// a result may differ from the AVX-512 rows' by one bf16 step, as from oneDNN's.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemv_wide.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_GEMV_AMX 1
#endif

namespace {

#if defined(PAGEDSERVE_GEMV_AMX)
constexpr int64_t kAmxMaxRows = 256;  // x [256, K] stays in L2 while every weight block passes
constexpr int64_t kAmxExactRows = 8;  // Q4_1 rows up to this: amx_q4_exact (exact d (x q) + m sum(x))

// Linux grants AMX state per process on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: A (two row tiles); tmm2, tmm3: B (two 16-output blocks); tmm4 .. tmm7: C [row tile][block]
inline TileConfig tile_config(int64_t tile_rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = (t == 2 || t == 3) ? 16 : static_cast<uint8_t>(tile_rows);
  }
  return c;
}

// rows of C (float32 [rows, 16], stride 64 bytes) -> bf16 out[m, n0 .. n0+16]
inline void store_rows(c10::BFloat16* out, int64_t out_stride, const float* c, int64_t rows, int64_t n0) {
  for (int64_t m = 0; m < rows; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + m * 16)));
}

// out[:, n0 .. n0 + 16 nb] for one or two blocks w[0], w[1] (pairs layout, K2 * 32 bf16 each), two row
// tiles at a time; x holds M rows, and whole tiles of tile_rows past them where M > tile_rows
inline void pair_rows(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride, int64_t M,
                      int64_t tile_rows, const c10::BFloat16* const* w, int nb, int64_t K2, int64_t n0) {
  alignas(64) float c[4][16 * 16];
  for (int64_t r0 = 0; r0 < M; r0 += 2 * tile_rows) {
    const bool two = r0 + tile_rows < M;
    const c10::BFloat16* x0 = x + r0 * x_stride;
    const c10::BFloat16* x1 = x0 + tile_rows * x_stride;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t t = 0; t < K2 / 16; ++t) {  // 32 k a step: B is 16 rows of 64 bytes
      _tile_loadd(0, x0 + 32 * t, x_stride * 2);
      _tile_loadd(2, w[0] + t * 512, 64);
      _tile_dpbf16ps(4, 0, 2);
      if (two) {
        _tile_loadd(1, x1 + 32 * t, x_stride * 2);
        _tile_dpbf16ps(6, 1, 2);
      }
      if (nb == 2) {
        _tile_loadd(3, w[1] + t * 512, 64);
        _tile_dpbf16ps(5, 0, 3);
        if (two) _tile_dpbf16ps(7, 1, 3);
      }
    }
    _tile_stored(4, c[0], 64);
    _tile_stored(5, c[1], 64);
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
    for (int64_t h = 0; h < (two ? 2 : 1); ++h) {
      const int64_t r = r0 + h * tile_rows, rows = std::min(tile_rows, M - r);
      for (int b = 0; b < nb; ++b) store_rows(out + r * out_stride, out_stride, c[2 * h + b], rows, n0 + 16 * b);
    }
  }
}

// every block pair of the weight, in parallel; widen(b, buffer) gives block b's pairs-layout bf16
template <typename Widen>
inline void amx_pairs(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride, int64_t M,
                      int64_t K2, int64_t num_blocks, int64_t scratch, const Widen& widen) {
  const int64_t tile_rows = std::min<int64_t>(M, 16);
  const TileConfig config = tile_config(tile_rows);
  const int64_t num_pairs = (num_blocks + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, 512 / std::max<int64_t>(1, K2 * ((M + 15) / 16)));
  at::parallel_for(0, num_pairs, grain, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&config);
    PairScratch room(scratch);
    c10::BFloat16* scratch_bf16 = room.data;
    for (int64_t p = begin; p < end; ++p) {
      const int nb = static_cast<int>(std::min<int64_t>(2, num_blocks - 2 * p));
      const c10::BFloat16* w[2] = {nullptr, nullptr};
      for (int b = 0; b < nb; ++b) w[b] = widen(2 * p + b, scratch_bf16 + b * scratch);
      pair_rows(out, out_stride, x, x_stride, M, tile_rows, w, nb, K2, 32 * p);
    }
    _tile_release();
  });
}

// bf16 pairs layout [N/16, K/2, 16, 2]: B tiles read in place
inline void amx_rows(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride, int64_t M,
                     const c10::BFloat16* packed, int64_t K2, int64_t num_blocks) {
  amx_pairs(out, out_stride, x, x_stride, M, K2, num_blocks, 0,
            [&](int64_t b, c10::BFloat16*) { return packed + b * K2 * 32; });
}

// Q4_1 past kAmxExactRows rows: each block widened once to bf16(d q + m) (cpu_gemv_wide.h's widen_q4)
inline void amx_q4_widened(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride, int64_t M,
                        const uint8_t* nib, const uint16_t* dm, int64_t K2, int64_t num_blocks) {
  amx_pairs(out, out_stride, x, x_stride, M, K2, num_blocks, K2 * 32, q4_widener(nib, dm, K2));
}
// Q4_1 for up to kAmxExactRows rows, the AVX-512 rows' sums: per 32-k group and block the nibbles widen
// to q itself (one table lookup) in an L1 B tile, C = x_g q_g, then acc += d C + m sum(x_g). Each row
// costs a C store and two fma per group, so past a few rows widening d q + m once wins.
inline void amx_q4_exact(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride,
                        const float* xsum, int64_t M, const uint8_t* nib, const uint16_t* dm, int64_t K2,
                        int64_t num_blocks) {
  const TileConfig config = tile_config(M);
  const int64_t num_groups = K2 / 16;
  const int64_t num_pairs = (num_blocks + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, 256 / std::max<int64_t>(1, K2));
  at::parallel_for(0, num_pairs, grain, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&config);
    alignas(64) uint16_t bt[2][16 * 32];  // two B tiles
    alignas(64) float c[2][16 * 16];
    // q (0..15) -> bf16 bits; vpermw reads an index's low 5 bits, so entry 16 + q repeats q's
    alignas(64) static const uint16_t kTable[32] = {
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
        0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
        0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i table = _mm512_load_si512(kTable);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b0 = 2 * p, nb = std::min<int64_t>(2, num_blocks - b0);
      __m512 acc[2][16];
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t m = 0; m < M; ++m) acc[b][m] = _mm512_setzero_ps();
      for (int64_t g = 0; g < num_groups; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* src = nib + ((b0 + b) * K2 + 16 * g) * 16;  // 8 row pairs of 32 bytes
          _mm_prefetch(reinterpret_cast<const char*>(src) + 1024, _MM_HINT_T0);
          for (int r = 0; r < 16; r += 2) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * 16)));
            _mm512_store_si512(bt[b] + r * 32, _mm512_permutexvar_epi16(v, table));
            _mm512_store_si512(bt[b] + r * 32 + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
          }
        }
        _tile_loadd(0, x + 32 * g, x_stride * 2);
        _tile_loadd(2, bt[0], 64);
        _tile_zero(4);
        _tile_dpbf16ps(4, 0, 2);
        if (nb == 2) {
          _tile_loadd(3, bt[1], 64);
          _tile_zero(5);
          _tile_dpbf16ps(5, 0, 3);
        }
        _tile_stored(4, c[0], 64);
        if (nb == 2) _tile_stored(5, c[1], 64);
        for (int64_t b = 0; b < nb; ++b) {
          const uint16_t* dmb = dm + ((b0 + b) * num_groups + g) * 32;
          const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmb)));
          const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmb + 16)));
          for (int64_t m = 0; m < M; ++m) {
            acc[b][m] = _mm512_fmadd_ps(d, _mm512_load_ps(c[b] + m * 16), acc[b][m]);
            acc[b][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * num_groups + g]), acc[b][m]);
          }
        }
      }
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t m = 0; m < M; ++m)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + (b0 + b) * 16),
                              (__m256i)_mm512_cvtneps_pbh(acc[b][m]));
    }
    _tile_release();
  });
}
#endif

}  // namespace
