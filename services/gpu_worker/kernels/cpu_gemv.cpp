// y = x @ W^T for a few bf16 rows (a lone request's decode step), streaming the weight once.
//
// oneDNN's packed bf16 GEMM is built for many rows and reads the weight far below memory
// bandwidth at one row on a CPU without AMX.
// Here the weight is stored once in pairs layout: W [N, K] -> P [N/16, K/2, 16, 2], so one
// 64-byte load holds 16 outputs' weights for two consecutive k, and vdpbf16ps against the
// broadcast pair (x[m, k], x[m, k+1]) adds both products into 16 float32 accumulators: no
// horizontal sums, and each weight load serves all M rows.
//
// Numerics: every product of two bf16 is exact in float32; sums are float32 in k order
// (pairs added together, as vdpbf16ps does), then rounded to bf16 (nearest even). oneDNN
// sums in another order, so a result may differ from it by one bf16 step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_tiling.h"
#include "cpu_gemv_amx.h"
#include "cpu_gemv_wide.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // rows per call of the AVX-512 loops (linear_amx*: max_amx_rows()); more go to oneDNN
constexpr int64_t kTile = 4;     // 16-output blocks per task step: independent dependency chains

#if defined(__AVX512BF16__)
// out[m, 16*b0 .. 16*(b0+NB)) for NB consecutive 16-output blocks and M rows
template <int M, int NB>
inline void tile(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride,
                 const c10::BFloat16* packed, int64_t K2, int64_t b0) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  const c10::BFloat16* w = packed + b0 * K2 * 32;  // block b starts at b * K2 * 32 elements
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) {
      const c10::BFloat16* p = w + (b * K2 + k2) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(p) + 1024, _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(p);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + k2]));
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xv, wv[b]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + (b0 + b) * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
}

template <int M>
void rows(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride,
          const c10::BFloat16* packed, int64_t K2, int64_t num_blocks) {
  const int64_t num_tiles = (num_blocks + kTile - 1) / kTile;
  // grain: a task streams at least ~64 KiB of weight, so a small projection stays on one thread
  const int64_t grain = std::max<int64_t>(1, 1024 / std::max<int64_t>(1, K2));
  at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kTile;
      switch (std::min(kTile, num_blocks - b0)) {
        case 4: tile<M, 4>(out, out_stride, x, x_stride, packed, K2, b0); break;
        case 3: tile<M, 3>(out, out_stride, x, x_stride, packed, K2, b0); break;
        case 2: tile<M, 2>(out, out_stride, x, x_stride, packed, K2, b0); break;
        default: tile<M, 1>(out, out_stride, x, x_stride, packed, K2, b0); break;
      }
    }
  });
}

// ---- Q4_1 weights (GGUF): w[n, k] = d[n, k/32] * q[n, k] + m[n, k/32], q in 0..15 --------
// Stored as row pairs nib [N/16, K/4, 32] (linear.amx_nibbles, the AMX tiles' layout): byte j of
// pair s holds bf16 j of pairs-layout step 2s (output j / 2, k 4s + j % 2) in its low nibble and
// of step 2s + 1 (k + 2) in its high one, so 32 bytes widen to two steps' weights by one vpmovzxbw,
// one shift and two table lookups. dm [N/16, K/32, 2, 16] fp16 (d then m of the 16 outputs). Per
// 32-k group and output: y += d * sum_k x_k q_k + m * sum_k x_k. q is exact in bf16, so the inner
// sums are exact products summed in float32 in k order, whatever the row count (a row's result
// does not depend on the rows beside it); the weights are the GGUF's exact values.
template <int M, int NB>
inline void tile_q4(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride,
                    const float* xsum, int64_t num_groups, const uint8_t* nib, const uint16_t* dm,
                    int64_t K2, int64_t b0) {
  // q (0..15) -> bf16 bits; vpermw reads an index's low 5 bits, so entry 16 + q repeats q's
  alignas(64) static const uint16_t kTable[32] = {
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
      0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kTable);
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 part[M][NB];
    for (int m = 0; m < M; ++m)
      for (int b = 0; b < NB; ++b) part[m][b] = _mm512_setzero_ps();
    for (int64_t s = 8 * g; s < 8 * g + 8; ++s) {  // pairs steps 2s, 2s + 1
      __m512bh w0[NB], w1[NB];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = nib + ((b0 + b) * K2 + 2 * s) * 16;  // block b0 + b holds K2 / 2 pairs of 32 bytes
        _mm_prefetch(reinterpret_cast<const char*>(p) + 512, _MM_HINT_T0);
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        w0[b] = (__m512bh)_mm512_permutexvar_epi16(v, table);
        w1[b] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      }
      for (int m = 0; m < M; ++m) {
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + 2 * s]));
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_dpbf16_ps(part[m][b], x0, w0[b]);
      }
      for (int m = 0; m < M; ++m) {
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * x_stride + 2 * s + 1]));
        for (int b = 0; b < NB; ++b) part[m][b] = _mm512_dpbf16_ps(part[m][b], x1, w1[b]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint16_t* dmb = dm + ((b0 + b) * num_groups + g) * 32;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmb)));
      const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dmb + 16)));
      for (int m = 0; m < M; ++m) {
        acc[m][b] = _mm512_fmadd_ps(d, part[m][b], acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[m * num_groups + g]), acc[m][b]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_stride + (b0 + b) * 16),
                          (__m256i)_mm512_cvtneps_pbh(acc[m][b]));
}

// 2 * M * NB accumulators <= 16 registers
template <int M>
constexpr int kBlocksPerTile = M <= 2 ? 4 : (M <= 4 ? 2 : 1);

template <int M>
void rows_q4(c10::BFloat16* out, int64_t out_stride, const uint32_t* x, int64_t x_stride, const float* xsum,
             const uint8_t* nib, const uint16_t* dm, int64_t K2, int64_t num_blocks) {
  constexpr int NB = kBlocksPerTile<M>;
  const int64_t num_groups = K2 / 16;
  over_tiles<NB>(num_blocks, K2,
      [&](int64_t b0) { tile_q4<M, NB>(out, out_stride, x, x_stride, xsum, num_groups, nib, dm, K2, b0); },
      [&](int64_t b) { tile_q4<M, 1>(out, out_stride, x, x_stride, xsum, num_groups, nib, dm, K2, b); });
}

#include "cpu_gemv_q8.h"
#endif

}  // namespace

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

int64_t max_rows() { return kMaxRows; }

// most rows of linear_amx and linear_q4_amx: 0 where the build or the OS has no AMX
int64_t max_amx_rows() {
#if defined(PAGEDSERVE_GEMV_AMX)
  if (amx_permitted()) return kAmxMaxRows;
#endif
  return 0;
}

// most rows of linear_wide and linear_q4_wide: 0 where the build has no AVX-512 BF16
int64_t max_wide_rows() {
#if defined(__AVX512BF16__)
  return kWideMaxRows;
#else
  return 0;
#endif
}

// weight [N, K] bf16 (N % 16 == 0, K % 2 == 0) -> [N/16, K/2, 16, 2] bf16
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "pack: a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "pack: N must be a multiple of 16 and K even");
  return weight.view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// out [M, N] = x [M, K] @ W^T, W given packed; M <= max_rows(); bf16, contiguous rows
void linear(torch::Tensor out, torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(supported(), "linear: this build has no AVX-512 BF16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
                  packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.dim() == 4,
              "linear: bf16 tensors, packed by pack()");
  const int64_t M = x.size(0), K2 = packed.size(1), num_blocks = packed.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * K2 && x.stride(1) == 1 && x.stride(0) % 2 == 0,
              "linear: x [M, K], contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == num_blocks * 16 && out.stride(1) == 1,
              "linear: out [M, N], contiguous rows");
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "linear: 1 to ", kMaxRows, " rows");
#if defined(__AVX512BF16__)
  auto* o = out.data_ptr<c10::BFloat16>();
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const auto* p = packed.data_ptr<c10::BFloat16>();
  const int64_t os = out.stride(0), xs = x.stride(0) / 2;  // xs in bf16 pairs
  by_rows(M, [&](auto r) { rows<decltype(r)::value>(o, os, xp, xs, p, K2, num_blocks); });
#endif
}

// x as the AMX tiles read it: past 16 rows, whole tiles of 16 (zero rows after M)
torch::Tensor amx_rows_of(const torch::Tensor& x) {
  const int64_t M = x.size(0);
  if (M <= 16 || M % 16 == 0) return x;
  torch::Tensor padded = torch::zeros({(M + 15) / 16 * 16, x.size(1)}, x.options());
  padded.narrow(0, 0, M).copy_(x);
  return padded;
}

// linear() by AMX tiles: M <= max_amx_rows(), K a multiple of 32
void linear_amx(torch::Tensor out, torch::Tensor x, torch::Tensor packed) {
  const int64_t M = x.size(0), K2 = packed.size(1);
  TORCH_CHECK(M >= 1 && M <= max_amx_rows() && K2 % 16 == 0, "linear_amx: 1 to ", max_amx_rows(),
              " rows, K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
                  packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  x.dim() == 2 && x.size(1) == 2 * K2 && x.stride(1) == 1 && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == packed.size(0) * 16 && out.stride(1) == 1,
              "linear_amx: bf16 x [M, K] and out [M, N], contiguous rows; W packed by pack()");
#if defined(PAGEDSERVE_GEMV_AMX)
  const torch::Tensor xt = amx_rows_of(x);
  amx_rows(out.data_ptr<c10::BFloat16>(), out.stride(0), xt.data_ptr<c10::BFloat16>(), xt.stride(0), M,
           packed.data_ptr<c10::BFloat16>(), K2, packed.size(0));
#endif
}

// linear() for up to max_wide_rows() rows, each block pair read once for all of them (cpu_gemv_wide.h)
void linear_wide(torch::Tensor out, torch::Tensor x, torch::Tensor packed) {
  const int64_t M = x.size(0), K2 = packed.size(1);
  TORCH_CHECK(M >= 1 && M <= max_wide_rows(), "linear_wide: 1 to ", max_wide_rows(), " rows");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16 &&
                  packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  x.dim() == 2 && x.size(1) == 2 * K2 && x.stride(1) == 1 && x.stride(0) % 2 == 0 && out.dim() == 2 &&
                  out.size(0) == M && out.size(1) == packed.size(0) * 16 && out.stride(1) == 1,
              "linear_wide: bf16 x [M, K] and out [M, N], contiguous rows; W packed by pack()");
#if defined(__AVX512BF16__)
  const c10::BFloat16* p = packed.data_ptr<c10::BFloat16>();
  wide_pairs(out.data_ptr<c10::BFloat16>(), out.stride(0), x.data_ptr<c10::BFloat16>(), x.stride(0), M, K2,
             packed.size(0), 0, [&](int64_t b, c10::BFloat16*) { return p + b * K2 * 32; });
#endif
}

// [M, K/32] float32: each row's sum over each 32-k group (Q4_1's m term)
std::vector<float> group_sums(const torch::Tensor& x, int64_t num_groups) {
  const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
  std::vector<float> xs(x.size(0) * num_groups);
  for (int64_t m = 0; m < x.size(0); ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float sum = 0.f;
      for (int64_t k = 32 * g; k < 32 * g + 32; ++k) sum += static_cast<float>(xb[m * x.stride(0) + k]);
      xs[m * num_groups + g] = sum;
    }
  return xs;
}

void check_q4(const char* name, torch::Tensor out, torch::Tensor x, torch::Tensor nib, torch::Tensor dm,
              int64_t K2, int64_t num_blocks, int64_t max_m) {
  TORCH_CHECK(supported(), name, ": this build has no AVX-512 BF16");
  TORCH_CHECK(nib.scalar_type() == torch::kUInt8 && nib.is_contiguous() && dm.scalar_type() == torch::kInt16 &&
                  dm.is_contiguous() && dm.numel() == num_blocks * K2 * 2,
              name, ": nibbles and dm from gguf_blocks.pack_q4_1()");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(1) == 2 * K2 && x.stride(1) == 1 &&
                  x.stride(0) % 2 == 0 && K2 % 16 == 0,
              name, ": x [M, K] bf16, contiguous rows, K a multiple of 32");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == num_blocks * 16 && out.stride(1) == 1,
              name, ": out [M, N] bf16, contiguous rows");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_m, name, ": 1 to ", max_m, " rows");
}

// out [M, N] = x [M, K] @ W^T, W the Q4_1 weight with its nibbles as row pairs [N/16, K/4, 32]
// (linear.amx_nibbles of gguf_blocks.pack_q4_1()); M <= max_rows()
void linear_q4(torch::Tensor out, torch::Tensor x, torch::Tensor nib, torch::Tensor dm) {
  const int64_t M = x.size(0), K2 = nib.size(1) * 2, num_blocks = nib.size(0);
  TORCH_CHECK(nib.dim() == 3 && nib.size(2) == 32, "linear_q4: nibbles as row pairs [N/16, K/4, 32]");
  check_q4("linear_q4", out, x, nib, dm, K2, num_blocks, kMaxRows);
#if defined(__AVX512BF16__)
  const std::vector<float> xs = group_sums(x, K2 / 16);
  auto* o = out.data_ptr<c10::BFloat16>();
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const uint8_t* np = nib.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>());
  const int64_t os = out.stride(0), xst = x.stride(0) / 2;
  by_rows(M, [&](auto r) { rows_q4<decltype(r)::value>(o, os, xp, xst, xs.data(), np, dp, K2, num_blocks); });
#endif
}

// linear_q4() by AMX tiles, W's nibbles as row pairs [N/16, K/4, 32] (linear.amx_nibbles); M <= max_amx_rows().
// Past kAmxExactRows rows: x @ bf16(W)^T, the bf16 weight oneDNN takes, read at 0.625 bytes a weight.
void linear_q4_amx(torch::Tensor out, torch::Tensor x, torch::Tensor nib, torch::Tensor dm) {
  const int64_t K2 = nib.size(1) * 2, num_blocks = nib.size(0);
  TORCH_CHECK(nib.dim() == 3 && nib.size(2) == 32, "linear_q4_amx: nibbles [N/16, K/4, 32]");
  check_q4("linear_q4_amx", out, x, nib, dm, K2, num_blocks, max_amx_rows());
#if defined(PAGEDSERVE_GEMV_AMX)
  const uint8_t* np = nib.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>());
  if (x.size(0) <= kAmxExactRows) {
    const std::vector<float> xs = group_sums(x, K2 / 16);
    amx_q4_exact(out.data_ptr<c10::BFloat16>(), out.stride(0), x.data_ptr<c10::BFloat16>(), x.stride(0), xs.data(),
                 x.size(0), np, dp, K2, num_blocks);
  } else {
    const torch::Tensor xt = amx_rows_of(x);
    amx_q4_widened(out.data_ptr<c10::BFloat16>(), out.stride(0), xt.data_ptr<c10::BFloat16>(), xt.stride(0),
                   x.size(0), np, dp, K2, num_blocks);
  }
#endif
}

// linear_q4() for up to max_wide_rows() rows: x @ bf16(W)^T, the bf16 weight oneDNN takes, each block
// widened once in L2 for all rows (cpu_gemv_wide.h)
void linear_q4_wide(torch::Tensor out, torch::Tensor x, torch::Tensor nib, torch::Tensor dm) {
  const int64_t K2 = nib.size(1) * 2, num_blocks = nib.size(0);
  TORCH_CHECK(nib.dim() == 3 && nib.size(2) == 32, "linear_q4_wide: nibbles as row pairs [N/16, K/4, 32]");
  check_q4("linear_q4_wide", out, x, nib, dm, K2, num_blocks, max_wide_rows());
#if defined(__AVX512BF16__)
  const auto* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr<int16_t>());
  wide_pairs(out.data_ptr<c10::BFloat16>(), out.stride(0), x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0), K2,
             num_blocks, K2 * 32, q4_widener(nib.data_ptr<uint8_t>(), dp, K2));
#endif
}

// out [M, N] = x [M, K] @ W^T, W in Q8_0 (q [N/16, K/2, 16, 2] int8 from linear.q8_pairs, d
// [N/16, K/32, 16] int16 from gguf_blocks.pack_q8_0); M <= max_rows(); bf16 x and out, contiguous rows
void linear_q8(torch::Tensor out, torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(supported(), "linear_q8: this build has no AVX-512 BF16");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.dim() == 4 && q.size(2) == 16 &&
                  q.size(3) == 2 && d.scalar_type() == torch::kInt16 && d.is_contiguous() && d.numel() * 32 == q.numel(),
              "linear_q8: q from linear.q8_pairs and d from gguf_blocks.pack_q8_0");
  const int64_t M = x.size(0), K2 = q.size(1), num_blocks = q.size(0);
  TORCH_CHECK(K2 % 16 == 0, "linear_q8: K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(1) == 2 * K2 && x.stride(1) == 1 &&
                  x.stride(0) % 2 == 0,
              "linear_q8: x [M, K] bf16, contiguous rows");
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.dim() == 2 && out.size(0) == M &&
                  out.size(1) == num_blocks * 16 && out.stride(1) == 1,
              "linear_q8: out [M, N] bf16, contiguous rows");
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "linear_q8: 1 to ", kMaxRows, " rows");
#if defined(__AVX512BF16__)
  auto* o = out.data_ptr<c10::BFloat16>();
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const int8_t* qp = q.data_ptr<int8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  const int64_t os = out.stride(0), xs = x.stride(0) / 2;
  by_rows(M, [&](auto r) { rows_q8<decltype(r)::value>(o, os, xp, xs, qp, dp, K2, num_blocks); });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "compiled with AVX-512 BF16");
  m.def("max_rows", &max_rows, "most rows linear(), linear_q4() and linear_q8() take");
  m.def("max_amx_rows", &max_amx_rows, "most rows linear_amx() and linear_q4_amx() take (0: no AMX)");
  m.def("pack", &pack, "bf16 weight [N, K] -> pairs layout [N/16, K/2, 16, 2]");
  m.def("linear", &linear, "out [M, N] = x [M, K] @ W^T for a few bf16 rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_q4", &linear_q4, "out [M, N] = x [M, K] @ W^T for a few bf16 rows, W in Q4_1",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_amx", &linear_amx, "linear() by AMX tiles", py::call_guard<py::gil_scoped_release>());
  m.def("linear_q4_amx", &linear_q4_amx, "linear_q4() by AMX tiles, nibbles as row pairs",
        py::call_guard<py::gil_scoped_release>());
  m.def("max_wide_rows", &max_wide_rows, "most rows linear_wide() and linear_q4_wide() take (0: no AVX-512 BF16)");
  m.def("linear_wide", &linear_wide, "linear() for many rows, each block pair read once",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_q4_wide", &linear_q4_wide, "linear_q4() for many rows, each block widened once to bf16",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_q8", &linear_q8, "out [M, N] = x [M, K] @ W^T for a few bf16 rows, W in Q8_0",
        py::call_guard<py::gil_scoped_release>());
}
