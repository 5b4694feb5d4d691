// y = x @ W^T for a few float32 rows, W in a GGUF block format (Q4_1 layers, Q8_0 LM head),
// with AVX2, FMA and F16C: any x86-64 CPU of the last decade. The few-row path of the
// float32 model, the default dtype where the CPU has no AVX-512 BF16. The blocks are 0.625
// (Q4_1) and 1.0625 (Q8_0) bytes a weight instead of 4.
//
// Numerics: the weights are the GGUF's exact values (d * q + m, d * q: what the loader
// dequantizes to); q is an exact small integer in float32, products and sums are float32,
// summed per 32-k group, then scaled by d. MKL sums in another order: results differ from
// F.linear in the last bits, not more.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_f32_tiles.h"
#include "cpu_tiling.h"

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_GEMV_F32 1
#endif

namespace {

#if defined(PAGEDSERVE_GEMV_F32)
constexpr bool supported_f32_build = true;
#else
constexpr bool supported_f32_build = false;
#endif

constexpr int64_t kMaxRows = 8;  // rows per call of linear_q4/q8
constexpr int64_t kMaxManyRows = 1024;  // of linear_q4/q8_many (rows' tiles dequantize once)
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif

#if defined(PAGEDSERVE_GEMV_F32)
// ---- Q4_1: w[n, k] = d[n, k/32] * q[n, k] + m[n, k/32], q in 0..15 -----------------------
// Nibbles [N/16, K/2, 16] and dm [N/16, K/32, 2, 16] fp16 (gguf_blocks.pack_q4_1). Per pair j and 16-output block: byte i's low nibble is
// q[n_i, 2j], its high one q[n_i, 2j+1]; 8 outputs per 8-lane vector, so a block is two
// halves. Even and odd k accumulate apart (4 independent FMA chains per block and row, so
// the FMA latency hides), are added per 32-k group, then y += d * S + m * sum(x).
template <int M, int NB>
inline void tile_q4_f32(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* xsum,
                        int64_t num_groups, const uint8_t* nib, const uint16_t* dm, int64_t K2, int64_t b0) {
  const __m256i low_nibble = _mm256_set1_epi32(0xF);
  __m256 acc[M][NB][2];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256 even[M][NB][2], odd[M][NB][2];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) even[m][b][h] = odd[m][b][h] = _mm256_setzero_ps();
    for (int64_t j = 16 * g; j < 16 * g + 16; ++j) {
      __m256 we[NB][2], wo[NB][2];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = nib + ((b0 + b) * K2 + j) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_cvtepu8_epi32(h ? _mm_unpackhi_epi64(bytes, bytes) : bytes);
          we[b][h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low_nibble));
          wo[b][h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m256 xe = _mm256_broadcast_ss(x + m * x_stride + 2 * j);
        const __m256 xo = _mm256_broadcast_ss(x + m * x_stride + 2 * j + 1);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) {
            even[m][b][h] = _mm256_fmadd_ps(we[b][h], xe, even[m][b][h]);
            odd[m][b][h] = _mm256_fmadd_ps(wo[b][h], xo, odd[m][b][h]);
          }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint16_t* dmb = dm + ((b0 + b) * num_groups + g) * 32;
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmb + 8 * h)));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dmb + 16 + 8 * h)));
        for (int m = 0; m < M; ++m) {
          const __m256 s = _mm256_add_ps(even[m][b][h], odd[m][b][h]);
          acc[m][b][h] = _mm256_fmadd_ps(d, s, acc[m][b][h]);
          acc[m][b][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[m * num_groups + g]), acc[m][b][h]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * out_stride + (b0 + b) * 16 + 8 * h, acc[m][b][h]);
}


// ---- Q8_0: w[n, k] = d[n, k/32] * q[n, k], q in -128..127 ----------------------------------
// q [N/16, K, 16] int8 (16 outputs' weights for one k in 16 bytes) and d [N/16, K/32, 16]
// fp16 (gguf_blocks.pack_q8_0). Per k: two 8-lane halves; even and odd k accumulate apart.
template <int M, int NB>
inline void tile_q8(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t num_groups,
                    const int8_t* qs, const uint16_t* ds, int64_t K, int64_t b0) {
  __m256 acc[M][NB][2];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b][0] = acc[m][b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m256 part[M][NB][2][2];  // [.., half, k parity]
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) part[m][b][h][0] = part[m][b][h][1] = _mm256_setzero_ps();
    for (int64_t k = 32 * g; k < 32 * g + 32; ++k) {
      __m256 w[NB][2];
      for (int b = 0; b < NB; ++b) {
        const int8_t* p = qs + ((b0 + b) * K + k) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        w[b][0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        w[b][1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes)));
      }
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + k);
        for (int b = 0; b < NB; ++b)
          for (int h = 0; h < 2; ++h) part[m][b][h][k & 1] = _mm256_fmadd_ps(w[b][h], xv, part[m][b][h][k & 1]);
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) {
        const uint16_t* dp = ds + ((b0 + b) * num_groups + g) * 16 + 8 * h;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dp)));
        for (int m = 0; m < M; ++m)
          acc[m][b][h] = _mm256_fmadd_ps(d, _mm256_add_ps(part[m][b][h][0], part[m][b][h][1]), acc[m][b][h]);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + m * out_stride + (b0 + b) * 16 + 8 * h, acc[m][b][h]);
}

#if defined(__AVX512F__)
// tile_q8 on 16 lanes (a 16-output block in one register, 3 M NB accumulators of 32 instead of
// 6 M NB of 16, so 4-8 rows do not spill): lane i does what tile_q8's half i / 8, lane i % 8 does,
// in the same order, so the results are the same bits.
template <int M, int NB>
inline void tile_q8_512(float* out, int64_t out_stride, const float* x, int64_t x_stride, int64_t num_groups,
                        const int8_t* qs, const uint16_t* ds, int64_t K, int64_t b0) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 part[M][NB][2];  // [.., k parity]
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) part[m][b][0] = part[m][b][1] = _mm512_setzero_ps();
    for (int64_t k = 32 * g; k < 32 * g + 32; ++k) {
      __m512 w[NB];
      for (int b = 0; b < NB; ++b) {
        const int8_t* p = qs + ((b0 + b) * K + k) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
        w[b] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      }
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * x_stride + k]);
        for (int b = 0; b < NB; ++b) part[m][b][k & 1] = _mm512_fmadd_ps(w[b], xv, part[m][b][k & 1]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const __m512 d = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds + ((b0 + b) * num_groups + g) * 16)));
      for (int m = 0; m < M; ++m)
        acc[m][b] = _mm512_fmadd_ps(d, _mm512_add_ps(part[m][b][0], part[m][b][1]), acc[m][b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + m * out_stride + (b0 + b) * 16, acc[m][b]);
}
#endif

template <typename Dequant>
void many_rows(float* out, int64_t os, const float* x, int64_t xs, int64_t M, int64_t num_blocks, int64_t K,
               const Dequant& dequant) {
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float w[kChunk * 16];
    for (int64_t b = begin; b < end; ++b) block_rows(out + 16 * b, os, x, xs, M, K, b, dequant, w);
  });
}
#endif

// x [M, K] and out [M, N] float32 with contiguous rows; the common checks of both kernels
void check_rows(const char* name, const torch::Tensor& out, const torch::Tensor& x, int64_t K, int64_t N,
                int64_t max_rows = kMaxRows) {
  TORCH_CHECK(supported_f32_build, name, ": this build has no AVX2/FMA/F16C");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) == K && x.stride(1) == 1, name,
              ": x [M, K] float32, contiguous rows");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == torch::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1,
              name, ": out [M, N] float32, contiguous rows");
  TORCH_CHECK(M >= 1 && M <= max_rows, name, ": 1 to ", max_rows, " rows");
  TORCH_CHECK(K / 32 <= 512, name, ": K up to 16384");
}

}  // namespace

bool supported() { return supported_f32_build; }

int64_t max_rows() { return kMaxRows; }

// out [M, N] = x [M, K] @ W^T, W in Q4_1 (nibbles [N/16, K/2, 16] uint8, dm [N/16, K/32, 2, 16] int16)
void linear_q4(torch::Tensor out, torch::Tensor x, torch::Tensor nib, torch::Tensor dm) {
  TORCH_CHECK(nib.scalar_type() == torch::kUInt8 && nib.is_contiguous() && nib.dim() == 3 && nib.size(2) == 16 &&
                  dm.scalar_type() == torch::kInt16 && dm.is_contiguous() && dm.numel() * 16 == nib.numel() * 2,
              "linear_q4: nibbles and dm from gguf_blocks.pack_q4_1");
  const int64_t K2 = nib.size(1), num_blocks = nib.size(0);
  check_rows("linear_q4", out, x, 2 * K2, 16 * num_blocks);
#if defined(PAGEDSERVE_GEMV_F32)
  const int64_t M = x.size(0), num_groups = K2 / 16, xst = x.stride(0), os = out.stride(0);
  const float* xf = x.data_ptr<float>();
  float xsum[kMaxRows * 512];  // [M, K/32]: each row's sum over each 32-k group (the m term)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float sum = 0.f;
      for (int64_t k = 32 * g; k < 32 * g + 32; ++k) sum += xf[m * xst + k];
      xsum[m * num_groups + g] = sum;
    }
  float* o = out.data_ptr<float>();
  const uint8_t* np = nib.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>());
  by_rows(M, [&](auto r) {
    constexpr int R = decltype(r)::value;
    constexpr int NB = R == 1 && kVectorRegisters == 32 ? 2 : 1;  // a second block spills 16 registers
    over_tiles<NB>(num_blocks, K2,
        [&](int64_t b0) { tile_q4_f32<R, NB>(o, os, xf, xst, xsum, num_groups, np, dp, K2, b0); },
        [&](int64_t b) { tile_q4_f32<R, 1>(o, os, xf, xst, xsum, num_groups, np, dp, K2, b); });
  });
#endif
}

// out [M, N] = x [M, K] @ W^T, W in Q8_0 (q [N/16, K, 16] int8, d [N/16, K/32, 16] int16)
void linear_q8(torch::Tensor out, torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.dim() == 3 && q.size(2) == 16 &&
                  d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.numel() * 32 == q.numel(),
              "linear_q8: q and d from gguf_blocks.pack_q8_0");
  const int64_t K = q.size(1), num_blocks = q.size(0);
  TORCH_CHECK(K % 32 == 0, "linear_q8: K a multiple of 32");
  check_rows("linear_q8", out, x, K, 16 * num_blocks);
#if defined(PAGEDSERVE_GEMV_F32)
  const int64_t M = x.size(0), num_groups = K / 32, xst = x.stride(0), os = out.stride(0);
  const float* xf = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  by_rows(M, [&](auto r) {
    constexpr int R = decltype(r)::value;
#if defined(__AVX512F__)
    constexpr int NB = R == 1 ? 4 : (R <= 3 ? 2 : 1);
    over_tiles<NB>(num_blocks, K,
        [&](int64_t b0) { tile_q8_512<R, NB>(o, os, xf, xst, num_groups, qp, dp, K, b0); },
        [&](int64_t b) { tile_q8_512<R, 1>(o, os, xf, xst, num_groups, qp, dp, K, b); });
#else
    constexpr int NB = R == 1 ? 2 : 1;
    over_tiles<NB>(num_blocks, K,
        [&](int64_t b0) { tile_q8<R, NB>(o, os, xf, xst, num_groups, qp, dp, K, b0); },
        [&](int64_t b) { tile_q8<R, 1>(o, os, xf, xst, num_groups, qp, dp, K, b); });
#endif
  });
#endif
}


// out [M, N] = x [M, K] @ W^T for any M up to kMaxManyRows: the weights dequantized once a tile
void linear_many(torch::Tensor out, torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  const bool q4 = q.scalar_type() == torch::kUInt8;
  TORCH_CHECK(q.is_contiguous() && q.dim() == 3 && q.size(2) == 16 && d.scalar_type() == torch::kInt16 && d.is_contiguous(),
              "linear_many: blocks from gguf_blocks.pack_q4_1 or pack_q8_0");
  TORCH_CHECK(q4 ? d.numel() * 16 == q.numel() * 2 : (q.scalar_type() == torch::kInt8 && d.numel() * 32 == q.numel()),
              "linear_many: blocks from gguf_blocks.pack_q4_1 or pack_q8_0");
  const int64_t K = q4 ? 2 * q.size(1) : q.size(1), num_blocks = q.size(0);
  TORCH_CHECK(K % 32 == 0, "linear_many: K a multiple of 32");
  check_rows("linear_many", out, x, K, 16 * num_blocks, kMaxManyRows);
#if defined(PAGEDSERVE_GEMV_F32)
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  float* o = out.data_ptr<float>();
  const float* xf = x.data_ptr<float>();
  if (q4)
    many_rows(o, out.stride(0), xf, x.stride(0), x.size(0), num_blocks, K, DequantQ4{q.data_ptr<uint8_t>(), dp, K});
  else
    many_rows(o, out.stride(0), xf, x.stride(0), x.size(0), num_blocks, K, DequantQ8{q.data_ptr<int8_t>(), dp, K});
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "compiled with AVX2, FMA and F16C");
  m.def("max_rows", &max_rows, "most rows a call takes");
  m.def("linear_q4", &linear_q4, "out [M, N] = x [M, K] @ W^T for a few float32 rows, W in Q4_1",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_many", &linear_many, "out [M, N] = x [M, K] @ W^T, W's Q4_1 (nibbles, dm) or Q8_0 (q, d) blocks",
        py::call_guard<py::gil_scoped_release>());
  m.def("max_many_rows", []() { return kMaxManyRows; }, "most rows linear_many takes");
  m.def("linear_q8", &linear_q8, "out [M, N] = x [M, K] @ W^T for a few float32 rows, W in Q8_0",
        py::call_guard<py::gil_scoped_release>());
}
