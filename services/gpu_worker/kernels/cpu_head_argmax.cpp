// Greedy tokens of a float32 LM head without its logits: from its bf16 screen (screened_argmax,
// screened_head.py), or from the many-row tiles (argmax_many, greedy_head.py).
//
// screened_argmax:
// approx [N, V] bf16 is the head's product in bf16, within scale[n] * norms[v] of the exact
// logit (norms [V]: the weight rows' 2-norms). With m the screen's argmax, the exact argmax
// v* has approx[n, v*] >= approx[n, m] - scale[n] * (norms[m] + norms[v*]), so only the v that
// pass that test are recomputed, as float32 dot products of hidden [N, H] and weight [V, H]
// accumulated in double; the largest wins, the first index on ties. A row is scanned in
// chunks of CHUNK logits: pass 1 keeps each chunk's maximum, pass 2 opens only the chunks
// that can hold a candidate. scale must be finite (the caller checks).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_f32_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t CHUNK = 64;

inline float widen(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline double dot(const float* a, const float* b, int64_t n) {
  double acc = 0.0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return acc;
}

inline float chunk_max(const uint16_t* x, int64_t n) {
  float best = -INFINITY;
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < n; ++i) best = std::max(best, widen(x[i]));
  return best;
}

// One row: (token, candidates recomputed). chunk_norms[c]: the largest norm in chunk c.
std::pair<int64_t, int64_t> row_argmax(const uint16_t* approx, const float* h, const float* weight,
                                       const float* norms, const float* chunk_norms, int64_t V, int64_t H,
                                       float scale, std::vector<float>& maxes) {
  const int64_t chunks = (V + CHUNK - 1) / CHUNK;
  float top = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) {
    maxes[c] = chunk_max(approx + c * CHUNK, std::min(CHUNK, V - c * CHUNK));
    top = std::max(top, maxes[c]);
  }
  int64_t m = 0;  // the screen's argmax: its bound enters every threshold
  while (m < V - 1 && widen(approx[m]) != top) ++m;
  const float threshold = top - scale * norms[m];
  int64_t at = 0, seen = 0;
  double best = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!(maxes[c] + scale * chunk_norms[c] >= threshold)) continue;
    const int64_t end = std::min(V, (c + 1) * CHUNK);
    for (int64_t v = c * CHUNK; v < end; ++v) {
      if (!(widen(approx[v]) + scale * norms[v] >= threshold)) continue;
      const double exact = dot(h, weight + v * H, H);
      if (seen++ == 0 || exact > best) {
        best = exact;
        at = v;
      }
    }
  }
  return {at, seen};
}


#if defined(PAGEDSERVE_F32_TILES)
// tokens[m]: row m's first argmax over x [M, K] @ W^T, W's 16-output blocks from dequant, the logits
// as linear_many computes them (cpu_f32_tiles.h). Lane j of a row keeps the best of outputs 16b + j
// (strictly greater replaces: the first of equals stays), then lanes and tasks merge (equal values:
// the lower index). False when some row has no logit above -inf (all NaN or -inf).
template <typename Dequant>
bool argmax_blocks(int64_t* tokens, const float* x, int64_t M, int64_t K, int64_t num_blocks, const Dequant& dequant) {
  const int64_t slots = at::get_num_threads();
  std::vector<float> best(slots * M, -INFINITY);
  std::vector<int64_t> where(slots * M, -1);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t slot = std::min<int64_t>(at::get_thread_num(), slots - 1);
    alignas(32) float w[kChunk * 16];
    std::vector<float> logits(M * 16), lane_best(M * 16, -INFINITY);
    std::vector<int32_t> lane_at(M * 16, -1);
    const __m256i lanes[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
    for (int64_t b = begin; b < end; ++b) {
      block_rows(logits.data(), 16, x, K, M, K, b, dequant, w);
      const __m256i base = _mm256_set1_epi32(static_cast<int32_t>(16 * b));
      for (int64_t i = 0; i < M * 16; i += 8) {
        const __m256 v = _mm256_loadu_ps(logits.data() + i), held = _mm256_loadu_ps(lane_best.data() + i);
        const __m256 gt = _mm256_cmp_ps(v, held, _CMP_GT_OQ);
        const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_at.data() + i));
        const __m256i index = _mm256_add_epi32(base, lanes[(i / 8) % 2]);
        _mm256_storeu_ps(lane_best.data() + i, _mm256_blendv_ps(held, v, gt));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_at.data() + i),
                            _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(index), gt)));
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t at = lane_at[m * 16 + j];
        float& top = best[slot * M + m];
        int64_t& top_at = where[slot * M + m];
        const float v = lane_best[m * 16 + j];
        if (at >= 0 && (top_at < 0 || v > top || (v == top && at < top_at))) {
          top = v;
          top_at = at;
        }
      }
  });
  bool found = true;
  for (int64_t m = 0; m < M; ++m) {
    float top = -INFINITY;
    int64_t top_at = -1;
    for (int64_t s = 0; s < slots; ++s) {
      const float v = best[s * M + m];
      const int64_t at = where[s * M + m];
      if (at >= 0 && (top_at < 0 || v > top || (v == top && at < top_at))) {
        top = v;
        top_at = at;
      }
    }
    tokens[m] = top_at;
    found = found && top_at >= 0;
  }
  return found;
}
#endif

}  // namespace

// tokens [M] int64 <- each row's argmax of x [M, K] float32 @ W^T (first on ties), W: Q8_0 blocks (q int8
// [N/16, K, 16], d), Q4_1 blocks (nibbles uint8 [N/16, K/2, 16], dm) (gguf_blocks.pack_*), or float32
// [N/16, K, 16] (d: empty). False: a row without a logit above -inf; the caller takes the plain head.
bool argmax_many(torch::Tensor tokens, torch::Tensor x, torch::Tensor w, torch::Tensor d) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(), "argmax_many: x [M, K] float32");
  TORCH_CHECK(tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous() && tokens.numel() == x.size(0),
              "argmax_many: tokens [M] int64");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 3 && w.size(2) == 16, "argmax_many: w [N/16, K(/2), 16]");
  const auto kind = w.scalar_type();
  const int64_t K = kind == torch::kUInt8 ? 2 * w.size(1) : w.size(1), M = x.size(0), num_blocks = w.size(0);
  TORCH_CHECK(x.size(1) == K && M >= 1, "argmax_many: x [M, K] with K the weight's");
  TORCH_CHECK(kind == torch::kFloat || (K % 32 == 0 && d.scalar_type() == torch::kInt16 && d.is_contiguous() &&
                                        d.numel() * (kind == torch::kUInt8 ? 16 : 32) == w.numel() * (kind == torch::kUInt8 ? 2 : 1)),
              "argmax_many: float32 tiles, or blocks from gguf_blocks.pack_q4_1 / pack_q8_0");
#if defined(PAGEDSERVE_F32_TILES)
  int64_t* tp = tokens.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  if (kind == torch::kFloat) return argmax_blocks(tp, xp, M, K, num_blocks, PackedF32{w.data_ptr<float>(), K});
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  if (kind == torch::kUInt8) return argmax_blocks(tp, xp, M, K, num_blocks, DequantQ4{w.data_ptr<uint8_t>(), dp, K});
  TORCH_CHECK(kind == torch::kInt8, "argmax_many: w float32, uint8 or int8");
  return argmax_blocks(tp, xp, M, K, num_blocks, DequantQ8{w.data_ptr<int8_t>(), dp, K});
#else
  TORCH_CHECK(false, "argmax_many: this build has no AVX2/FMA/F16C");
  return false;
#endif
}

bool has_argmax_many() {
#if defined(PAGEDSERVE_F32_TILES)
  return true;
#else
  return false;
#endif
}

// -> (tokens [N] int64, candidates recomputed per row [N] int64)
std::vector<torch::Tensor> screened_argmax(torch::Tensor approx, torch::Tensor hidden, torch::Tensor weight,
                                           torch::Tensor norms, torch::Tensor scale) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == torch::kBFloat16 && approx.is_contiguous(),
              "screened_argmax approx: [N, V] bf16, contiguous");
  for (const auto* t : {&hidden, &weight})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "screened_argmax hidden [N, H], weight [V, H]: float32, contiguous");
  for (const auto* t : {&norms, &scale})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "screened_argmax norms [V], scale [N]: float32");
  const int64_t N = approx.size(0), V = approx.size(1), H = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == N && scale.size(0) == N && weight.size(0) == V && weight.size(1) == H &&
                  norms.size(0) == V,
              "screened_argmax: shapes disagree");
  auto tokens = torch::empty({N}, torch::kInt64);
  auto seen = torch::empty({N}, torch::kInt64);
  const uint16_t* a = reinterpret_cast<const uint16_t*>(approx.data_ptr<bf16>());
  const float* hp = hidden.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* np = norms.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  std::vector<float> chunk_norms((V + CHUNK - 1) / CHUNK, 0.f);
  for (int64_t v = 0; v < V; ++v) chunk_norms[v / CHUNK] = std::max(chunk_norms[v / CHUNK], np[v]);
  int64_t* tp = tokens.data_ptr<int64_t>();
  int64_t* cp = seen.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> maxes(chunk_norms.size());
    for (int64_t n = begin; n < end; ++n) {
      auto [token, count] = row_argmax(a + n * V, hp + n * H, wp, np, chunk_norms.data(), V, H, sp[n], maxes);
      tp[n] = token;
      cp[n] = count;
    }
  });
  return {tokens, seen};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("screened_argmax", &screened_argmax, "argmax of a float32 LM head from its bf16 screen",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_many", &argmax_many, "greedy tokens of a float32 head from its many-row tiles, no logits",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_argmax_many", &has_argmax_many, "compiled with AVX2, FMA and F16C");
}
