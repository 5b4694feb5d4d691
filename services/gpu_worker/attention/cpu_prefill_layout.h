// cpu_prefill.cpp's pass 1: one (request, KV head)'s K and V copied from the pool (bf16, or int8 rows
// dequantized: kv_quant.py's format, cpu_kv_int8.h) into the layouts vdpbf16ps and AMX read.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_kv_int8.h"

namespace {

constexpr int kKeys = 16;  // keys per chunk (one zmm of fp32 scores)

struct Prefill {
  const uint32_t* kt;  // [chunks][DH / 2][16]: dword = dims (2i, 2i+1) of one key
  const uint32_t* vp;  // [chunks * 8][D]: dword = one dim of keys (2j, 2j+1)
  int64_t q_start, q_len, seq_len;
};

// A pool row in bf16 bits: bf16 as stored; int8 (kv_quant.py) as q * its group's scale, exact in float32
// (8 x 5 significant bits), rounded to nearest even: the bits torch's dequantize(...).to(bfloat16) gives.
template <int DH>
inline void row_bf16(uint16_t* dst, const uint16_t* row) { std::memcpy(dst, row, DH * 2); }
template <int DH>
inline void row_bf16(uint16_t* dst, const int8_t* row) {
  for (int g = 0; g < DH / 32; ++g) {
    const __m512 s = _mm512_set1_ps(kv_int8::scale(row, DH, g));
    for (int h = 0; h < 2; ++h) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g + 16 * h));
      const __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * g + 16 * h), (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

// Pass 1, one (request, KV head): K and V in vdpbf16ps layouts, zero past seq_len (scores masked);
// W elements a pool row (DH, or int8's DH + packed scales)
template <int DH, typename kv_t>
void lay_out(uint32_t* kt, uint32_t* vp, const kv_t* k_pool, const kv_t* v_pool, const int32_t* table,
             int64_t seq_len, int64_t BS, int64_t token_stride, int64_t W, int64_t kv_head) {
  const int64_t num_chunks = 2 * ((seq_len + 2 * kKeys - 1) / (2 * kKeys));  // as prefill() sizes it
  std::memset(kt, 0, num_chunks * (DH / 2) * kKeys * 4);
  std::memset(vp, 0, num_chunks * (kKeys / 2) * DH * 4);
  alignas(64) uint16_t k[DH], v[DH];
  for (int64_t t = 0; t < seq_len; ++t) {
    const int64_t offset = table[t / BS] * BS * token_stride + (t % BS) * token_stride + kv_head * W;
    row_bf16<DH>(k, k_pool + offset);
    row_bf16<DH>(v, v_pool + offset);
    uint32_t* kt_chunk = kt + (t / kKeys) * (DH / 2) * kKeys + t % kKeys;
    for (int i = 0; i < DH / 2; ++i) kt_chunk[i * kKeys] = k[2 * i] | (static_cast<uint32_t>(k[2 * i + 1]) << 16);
    uint16_t* vp_row = reinterpret_cast<uint16_t*>(vp + (t / 2) * DH) + (t % 2);
    for (int d = 0; d < DH; ++d) vp_row[2 * d] = v[d];
  }
}

}  // namespace
#endif
