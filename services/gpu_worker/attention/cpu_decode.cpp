// Paged decode attention on the CPU, straight from the block pool (no gather).
//
// One query token per request (a decode). Each of its H query heads (head j reads KV head
// j / G, G = H / Hkv) walks the request's blocks in order: per block, scores for its (up to)
// block_size tokens, then an online-softmax update of the running max m, sum l and the
// unnormalised output acc (the seeds' "block by block" softmax). K/V are read once,
// where they lie in the pool; the torch path instead copies every block into a workspace
// and reads it again in SDPA, three passes over the KV instead of one.
//
// Shapes (all contiguous, float32):
//   query, out   [T, H, D]             T flat tokens of the step; rows token_idx[r] are decodes
//   kv_cache     [2, NB, BS, Hkv, D]   index 0 K, 1 V
//   block_tables [R, max_blocks] int32 seq_lens [R] int32   token_idx [R] int64
// Requests are split over at::parallel_for threads; each writes only its own rows of out,
// so there is no sharing between threads. Built with -ffast-math so the exp loop
// vectorises; every value stays finite (kNoScore, not -inf), as fast-math requires.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr float kNoScore = -1e30f;  // finite "minus infinity": exp(kNoScore - x) == 0

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor token_idx,
                            double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous() &&
                  block_tables.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  const int64_t num_reqs = token_idx.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * D;  // between consecutive tokens of one block
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* k_pool = kv_cache.data_ptr<float>();
  const float* v_pool = k_pool + NB * BS * Hkv * D;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = token_idx.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // One work item per request: its blocks are walked once, in order, all heads together,
  // so each block's K (then V) rows are read as one sequential stretch of the pool.
  at::parallel_for(0, num_reqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H * D), m(H), l(H), p(BS);
    for (int64_t r = begin; r < end; ++r) {
      const float* q_rows = q + rows[r] * H * D;  // H query rows of D; head j reads KV head j / G
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[r];
      for (int64_t b = 0; b * BS < len; ++b) {
        const int64_t block = tables[r * max_blocks + b];
        const int64_t num_tokens = std::min(BS, len - b * BS);
        const float* k_block = k_pool + block * BS * token_stride;
        const float* v_block = v_pool + block * BS * token_stride;
        for (int64_t j = 0; j < H; ++j) {
          const float* qj = q_rows + j * D;
          const int64_t kv_offset = (j / G) * D;
          float block_max = kNoScore;
          for (int64_t t = 0; t < num_tokens; ++t) {
            p[t] = dot(qj, k_block + t * token_stride + kv_offset, D) * fscale;
            block_max = std::max(block_max, p[t]);
          }
          const float new_m = std::max(m[j], block_max);
          const float correction = std::exp(m[j] - new_m);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < num_tokens; ++t) {
            p[t] = std::exp(p[t] - new_m);
            sum += p[t];
          }
          float* aj = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) aj[d] *= correction;
          for (int64_t t = 0; t < num_tokens; ++t) {
            const float weight = p[t];
            const float* vt = v_block + t * token_stride + kv_offset;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) aj[d] += weight * vt[d];
          }
          m[j] = new_m;
          l[j] = l[j] * correction + sum;
        }
      }
      float* out_rows = o + rows[r] * H * D;
      for (int64_t j = 0; j < H; ++j) {
        const float inv = len > 0 ? 1.f / l[j] : 0.f;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) out_rows[j * D + d] = acc[j * D + d] * inv;
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the block pool (CPU)");
}
