// AMX tiles for cpu_gemv.cpp: out [M, N] = x [M, K] @ W^T for 2 to 16 bf16 rows (a verify step),
// reading each weight tile once for all rows. The AVX-512 loops issue one vdpbf16ps per row and
// 32 weights, so their cost grows with M; one tdpbf16ps takes [M, 32] x [32, 16] whatever M is.
//
// A tile: x[:, 32t .. 32t+32] (M rows of 64 bytes, read in place). B tile: 16 outputs' weights
// for those 32 k in pairs layout (16 rows k2 of [16 outputs][2] bf16), which is the packed bf16
// weight itself and what the Q4_1 nibbles widen to. C tile: [M, 16] float32.
// Numerics: exact products summed in float32 (in the tile unit's order, not vdpbf16ps's): a
// result may differ from the AVX-512 rows' by one bf16 step, as from oneDNN's.
#pragma once
#include <ATen/Parallel.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_GEMV_AMX 1
#endif

namespace {

#if defined(PAGEDSERVE_GEMV_AMX)
constexpr int64_t kAmxMaxRows = 16;

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

// tmm0, tmm1: A (M rows); tmm2, tmm3: B (16 rows); tmm4 .. tmm7: C (M rows); 64 bytes a row
inline TileConfig tile_config(int64_t M) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = (t == 2 || t == 3) ? 16 : static_cast<uint8_t>(M);
  }
  return c;
}

// rows of C (float32 [M, 16], stride 64 bytes) -> bf16 out[m, n0 .. n0+16]
inline void store_rows(c10::BFloat16* out, int64_t out_stride, const float* c, int64_t M, int64_t n0) {
  for (int64_t m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + m * 16)));
}

// bf16 pairs layout [N/16, K/2, 16, 2]: two 16-output blocks at a time, C summed over all of K
inline void amx_rows(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride, int64_t M,
                     const c10::BFloat16* packed, int64_t K2, int64_t num_blocks) {
  const TileConfig config = tile_config(M);
  const int64_t num_pairs = (num_blocks + 1) / 2;
  const int64_t grain = std::max<int64_t>(1, 512 / std::max<int64_t>(1, K2));
  at::parallel_for(0, num_pairs, grain, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&config);
    alignas(64) float c[2][16 * 16];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b0 = 2 * p;
      const bool two = b0 + 1 < num_blocks;
      const c10::BFloat16* w0 = packed + b0 * K2 * 32;
      const c10::BFloat16* w1 = w0 + K2 * 32;
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t t = 0; t < K2 / 16; ++t) {  // 32 k a step: B is 16 rows of 64 bytes
        _tile_loadd(0, x + 32 * t, x_stride * 2);
        _tile_loadd(2, w0 + t * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        if (two) {
          _tile_loadd(3, w1 + t * 512, 64);
          _tile_dpbf16ps(5, 0, 3);
        }
      }
      _tile_stored(4, c[0], 64);
      store_rows(out, out_stride, c[0], M, b0 * 16);
      if (two) {
        _tile_stored(5, c[1], 64);
        store_rows(out, out_stride, c[1], M, (b0 + 1) * 16);
      }
    }
    _tile_release();
  });
}

// Q4_1 weights as row pairs (linear.py's amx_nibbles): nib [N/16, K/4, 32], byte j of pair s holding B row
// 2s's bf16 j in its low nibble and row 2s+1's in its high one, so a row widens by one vpmovzxbw (or
// shift) and one table lookup; dm [N/16, K/32, 2, 16] fp16 (cpu_gemv.cpp's). Per 32-k group and block
// the nibbles widen to a bf16 B tile in L1, C = x_g q_g, then acc += d C + m sum(x_g).
inline void amx_rows_q4(c10::BFloat16* out, int64_t out_stride, const c10::BFloat16* x, int64_t x_stride,
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
