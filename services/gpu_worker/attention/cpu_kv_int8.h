// kv_quant.py's int8 row in C++: per (token, KV head) D int8 values in groups of group(D) (32 where
// D allows), each group's scale max|x| / 127 rounded up to 12 bits (float32's bits 19-30), two
// scales packed in 3 bytes after the values. Read by the decode and prefill kernels; written by
// quantize_row, which gives kv_quant.quantize's bytes exactly (the write path of every CPU step).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kv_int8 {

constexpr int kScaleShift = 19;  // a scale's 12 bits are float32 bits 19-30 (the sign, 0, dropped)
constexpr uint32_t kMinBits = 1u << 4;  // exponent 1: a zero group's scale stays normal

constexpr int64_t group(int64_t D) { return D % 32 == 0 ? 32 : D; }
constexpr int64_t scale_bytes(int64_t D) { return 3 * ((D / group(D) + 1) / 2); }
constexpr int64_t width(int64_t D) { return D + scale_bytes(D); }

inline float scale(const int8_t* row, int64_t D, int64_t g) {  // group g's scale
  const uint8_t* b = reinterpret_cast<const uint8_t*>(row + D) + 3 * (g / 2);
  const uint32_t pair = uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16);
  const uint32_t bits = (g % 2 ? pair >> 12 : pair & 0xFFFu) << kScaleShift;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t round_up_bits(uint32_t step_bits) {  // max|x| / 127's float32 bits -> the scale's 12
  return std::max((step_bits + (1u << kScaleShift) - 1) >> kScaleShift, kMinBits);  // nothing clips
}

inline void pack_scales(const uint32_t* bits, int64_t groups, int8_t* scales) {  // bits[groups] even-padded
  uint8_t* packed = reinterpret_cast<uint8_t*>(scales);
  for (int64_t g = 0; g < groups; g += 2) {
    const uint32_t pair = bits[g] | (bits[g + 1] << 12);
    packed[3 * (g / 2)] = pair & 0xFF;
    packed[3 * (g / 2) + 1] = (pair >> 8) & 0xFF;
    packed[3 * (g / 2) + 2] = (pair >> 16) & 0xFF;
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {  // bf16 bits -> float32
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// quantize_row for D % 32 == 0: divisions with embedded rounding (-ffast-math cannot make them
// multiplies), conversion round-half-even: the same bytes as the scalar loop.
template <typename T>
void quantize_row_avx512(const T* x, int8_t* row, int64_t D) {
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  uint32_t bits[16] = {};
  for (int64_t g = 0; g < D / 32; ++g) {
    const __m512 a = load16(x + 32 * g), b = load16(x + 32 * g + 16);
    const __m512 amax = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
    const __m512 step = _mm512_div_round_ps(_mm512_set1_ps(_mm512_reduce_max_ps(amax)), _mm512_set1_ps(127.f), kRne);
    bits[g] = round_up_bits(static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_castsi512_si128(_mm512_castps_si512(step)))));
    const __m512 s = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(bits[g] << kScaleShift)));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_cvt_roundps_epi32(_mm512_div_round_ps(h ? b : a, s, kRne), kRne);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 32 * g + 16 * h),
                       _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi)));
    }
  }
  pack_scales(bits, D / 32, row + D);
}
#endif

// x [D] (widened to float32 by `load`) -> row [width(D)]. IEEE division and round-half-even, as
// torch computes them: the extension's -ffast-math would turn x / s into x * (1 / s) and move values
// across a rounding boundary, so this loop is compiled without it.
template <typename T, typename Load>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-fast-math")))
#endif
void quantize_row_scalar(const T* x, int8_t* row, int64_t D, Load load) {
  const int64_t gs = group(D), groups = D / gs;
  uint32_t bits[16] = {};  // D <= 512
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.f;
    for (int64_t d = g * gs; d < (g + 1) * gs; ++d) amax = std::max(amax, std::fabs(load(x[d])));
    const float step = amax / 127.f;
    uint32_t b;
    std::memcpy(&b, &step, sizeof b);
    bits[g] = round_up_bits(b);
    const uint32_t s_bits = bits[g] << kScaleShift;
    float s;
    std::memcpy(&s, &s_bits, sizeof s);
    for (int64_t d = g * gs; d < (g + 1) * gs; ++d)
      row[d] = static_cast<int8_t>(std::clamp(std::nearbyint(load(x[d]) / s), -127.f, 127.f));
  }
  pack_scales(bits, groups, row + D);
}

// One (token, KV head) row x [D] of float, or of a 16-bit bf16 type (widened by `load`), into `row`.
template <typename T, typename Load>
void quantize_row(const T* x, int8_t* row, int64_t D, Load load) {
  static_assert(std::is_same_v<T, float> || sizeof(T) == 2, "float32 or bf16 rows");
#if defined(__AVX512F__)
  if (D % 32 == 0) {
    if constexpr (std::is_same_v<T, float>) return quantize_row_avx512(x, row, D);
    else return quantize_row_avx512(reinterpret_cast<const uint16_t*>(x), row, D);
  }
#endif
  quantize_row_scalar(x, row, D, load);
}

}  // namespace kv_int8
