// The online softmax's pieces for cpu_prefill.cpp's AVX-512 BF16 walks: exp of non-positive scores,
// a tile's running state (unnormalised O, max m, sum l) and its finished rows into out.
#pragma once
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_prefill_layout.h"  // Prefill

namespace {

constexpr float kNoScore = -1e30f;  // finite "minus infinity": exp(kNoScore - x) == 0
constexpr int kRows = 16;           // query rows per tile

// exp(x), x <= 0: 2^n * 2^f, f in [-1/2, 1/2] by degree-6 Taylor (rel. error < 2e-7 << bf16's 4e-3);
// 0 below -87, where e^x would be a denormal: Intel cores take a microcode assist for each one
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// One row's online-softmax step over 16 * n16 scores s (scaled; masked keys at kNoScore): P = e^(s - new max)
// into p as bf16 in key order, m and l moved on; returns the factor for the row's O so far
inline float softmax_update(const float* s, int n16, uint16_t* p, float& m, float& l) {
  __m512 top = _mm512_load_ps(s);
  for (int j = 1; j < n16; ++j) top = _mm512_max_ps(top, _mm512_load_ps(s + 16 * j));
  const float new_m = std::max(m, _mm512_reduce_max_ps(top));
  const __m512 shift = _mm512_set1_ps(new_m);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n16; ++j) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(s + 16 * j), shift));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * j), (__m256i)_mm512_cvtneps_pbh(e));
  }
  const float correction = m == kNoScore ? 0.f : std::exp(m - new_m);
  l = l * correction + _mm512_reduce_add_ps(sum);
  m = new_m;
  return correction;
}

// One tile's online-softmax state: unnormalised O, running max m and sum l per row
template <int DH>
struct RowState {
  alignas(64) float o[kRows][DH];
  float m[kRows], l[kRows], correction[kRows];
  RowState() {
    std::fill(&o[0][0], &o[0][0] + kRows * DH, 0.f);
    std::fill(m, m + kRows, kNoScore);
    std::fill(l, l + kRows, 0.f);
  }
};

// A tile's finished rows, O / l rounded to bf16, into out at their (position, head)
template <int DH>
void write_rows(uint16_t* out, const RowState<DH>& st, const Prefill& pf, int64_t row0, int64_t num_rows,
                int64_t G, int64_t H, int64_t kv_head) {
  const auto& o = st.o;
  const float* l = st.l;
  for (int r = 0; r < num_rows; ++r) {
    const int64_t i = row0 + r;
    uint16_t* dst = out + ((pf.q_start + i / G) * H + kv_head * G + i % G) * DH;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int dv = 0; dv < DH / 16; ++dv) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&o[r][16 * dv]), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * dv), (__m256i)rounded);
    }
  }
}

}  // namespace
#endif
