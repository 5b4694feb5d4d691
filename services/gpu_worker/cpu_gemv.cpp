// y = x @ W^T for a few bf16 rows (a lone request's decode step), streaming the weight once.
//
// oneDNN's packed bf16 GEMM is built for many rows; on a CPU with AVX-512 BF16 but no AMX
// it reads SmolLM2's weights at a third of the memory bandwidth when a step has one row.
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

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 8;  // rows per call; more go to oneDNN
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
  switch (M) {
    case 1: rows<1>(o, os, xp, xs, p, K2, num_blocks); break;
    case 2: rows<2>(o, os, xp, xs, p, K2, num_blocks); break;
    case 3: rows<3>(o, os, xp, xs, p, K2, num_blocks); break;
    case 4: rows<4>(o, os, xp, xs, p, K2, num_blocks); break;
    case 5: rows<5>(o, os, xp, xs, p, K2, num_blocks); break;
    case 6: rows<6>(o, os, xp, xs, p, K2, num_blocks); break;
    case 7: rows<7>(o, os, xp, xs, p, K2, num_blocks); break;
    default: rows<8>(o, os, xp, xs, p, K2, num_blocks); break;
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "compiled with AVX-512 BF16");
  m.def("max_rows", &max_rows, "most rows linear() takes");
  m.def("pack", &pack, "bf16 weight [N, K] -> pairs layout [N/16, K/2, 16, 2]");
  m.def("linear", &linear, "out [M, N] = x [M, K] @ W^T for a few bf16 rows",
        py::call_guard<py::gil_scoped_release>());
}
