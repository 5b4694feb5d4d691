// Greedy tokens of a float32 LM head from its bf16 screen (screened_head.py).
//
// approx [N, V] bf16 is the head's product in bf16, within scale[n] * norms[v] of the exact
// logit (norms [V]: the weight rows' 2-norms). With m the screen's argmax, the exact argmax
// v* has approx[n, v*] >= approx[n, m] - scale[n] * (norms[m] + norms[v*]), so only the v that
// pass that test are recomputed, as float32 dot products of hidden [N, H] and weight [V, H]
// accumulated in double; the largest wins, the first index on ties. A row is scanned in
// chunks of CHUNK logits: pass 1 keeps each chunk's maximum, pass 2 opens only the chunks
// that can hold a candidate. scale must be finite (the caller checks).
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

}  // namespace

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
}
