// Paged decode attention on the CPU, straight from the block pool (no gather).
//
// One query token per request (a decode). Work items are (request, KV head) pairs: the G = H / Hkv
// query heads of a group (head j reads KV head j / G) walk the request's blocks in order
// together, so every K and V row is read once, where it lies in the pool. Per block: scores
// for its (up to) block_size tokens, then an online-softmax update of the running max m, sum
// l and the unnormalised output acc (the seeds' "block by block" softmax). The torch path
// instead copies every block into a workspace and reads it again in SDPA: three passes over
// the KV instead of one.
//
// Shapes (contiguous; query and out float32 or bfloat16, kv_cache the same or int8):
//   query, out   [T, H, D]             T flat tokens of the step; rows token_idx[r] are decodes
//                                      (query's rows may be strided: a view of the fused qkv)
//   kv_cache     [2, NB, BS, Hkv, D]   index 0 K, 1 V; int8: [.., D + S], each row's group scales
//                                      after its values (kv_quant.py, KvRow), dequantized here
//   block_tables [R, max_blocks] int32 seq_lens [R] int32   token_idx [R] int64
// Arithmetic is float32 whatever the storage: bf16 is widened on load (a 16-bit shift) and
// the output rounded to nearest-even once at the end (the bf16 walk rounds PV's weights too). The AVX-512 paths hand requests out
// longest first, one at a time (WorkQueue); each writes only its own rows of out (or its
// slice's partials), so threads share nothing but the queue's counter.
// bf16 pools on AVX-512 BF16 take cpu_decode_bf16.h's walk (vdpbf16ps for QK and PV).
// Built with -ffast-math so the exp loop vectorises; every value stays finite (kNoScore,
// not -inf), as fast-math requires.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_decode_work.h"
#include "cpu_decode_simd.h"
#include "cpu_decode_bf16.h"
#include "cpu_decode_int8.h"
#include "cpu_decode_int8_avx512.h"

namespace {

template <typename scalar_t, typename kv_t>
void decode(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
            torch::Tensor seq_lens, torch::Tensor token_idx, float scale) {
  const int64_t num_reqs = token_idx.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(1), BS = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t W = KvRow<kv_t>::width(D);  // a pool row: D, or D + packed scales for int8
  const int64_t GS = KvRow<kv_t>::group(D);  // values per scale
  const int64_t token_stride = Hkv * W;  // between consecutive tokens of one block
  const scalar_t* q = query.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const kv_t* k_pool = kv_cache.data_ptr<kv_t>();
  const kv_t* v_pool = k_pool + NB * BS * token_stride;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* rows = token_idx.data_ptr<int64_t>();
  const int64_t q_stride = query.stride(0);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<kv_t, scalar_t>) {
    if (DecodeBf16Fn fn = pick_avx512_bf16(D, G, BS)) {
      fn(o, q, k_pool, v_pool, tables, lens, rows, num_reqs, q_stride, Hkv, BS, max_blocks, scale);
      return;
    }
  }
#endif
#if defined(PAGEDSERVE_DECODE_INT8)
  if constexpr (std::is_same_v<kv_t, int8_t>) {
#if defined(PAGEDSERVE_DECODE_INT8_AVX512)
    if (DecodeInt8Fn<scalar_t> fn = pick_int8_avx512<scalar_t>(D, G)) {
      fn(o, q, k_pool, v_pool, tables, lens, rows, num_reqs, q_stride, Hkv, BS, max_blocks, scale);
      return;
    }
#endif
    if (DecodeInt8Fn<scalar_t> fn = pick_int8<scalar_t>(D, G)) {
      fn(o, q, k_pool, v_pool, tables, lens, rows, num_reqs, q_stride, Hkv, BS, max_blocks, scale);
      return;
    }
  }
#endif
#if defined(PAGEDSERVE_DECODE_SIMD)
  if constexpr (!std::is_same_v<kv_t, int8_t>) {
    if (DecodeFn<scalar_t> fn = pick_simd<scalar_t>(D, G)) {
      fn(o, q, k_pool, v_pool, tables, lens, rows, num_reqs, q_stride, Hkv, BS, max_blocks, scale);
      return;
    }
  }
#endif

  at::parallel_for(0, num_reqs * Hkv, 1, [&](int64_t begin, int64_t end) {
    // qf [G, D] scaled query rows; acc [G, D]; p [G, BS] the block's scores, then weights
    std::vector<float> qf(G * D), acc(G * D), p(G * BS), m(G), l(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / Hkv, kv_head = item % Hkv;
      const scalar_t* q_rows = q + rows[r] * q_stride + kv_head * G * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = widen(q_rows[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t len = lens[r];
      for (int64_t b = 0; b * BS < len; ++b) {
        const int64_t block = tables[r * max_blocks + b];
        const int64_t num_tokens = std::min(BS, len - b * BS);
        const kv_t* k_block = k_pool + block * BS * token_stride + kv_head * W;
        const kv_t* v_block = v_pool + block * BS * token_stride + kv_head * W;
        for (int64_t t = 0; t < num_tokens; ++t) {
          const kv_t* kt = k_block + t * token_stride;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
            for (int64_t d0 = 0; d0 < D; d0 += GS) {  // per scale group (unquantized: one)
              float part = 0.f;
#pragma omp simd reduction(+ : part)
              for (int64_t d = d0; d < d0 + GS; ++d) part += qg[d] * widen(kt[d]);
              s += part * KvRow<kv_t>::scale(kt, D, d0 / GS);
            }
            p[g * BS + t] = s;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float correction = softmax_block(p.data() + g * BS, num_tokens, m[g], l[g]);
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
        }
        for (int64_t t = 0; t < num_tokens; ++t) {
          const kv_t* vt = v_block + t * token_stride;
          for (int64_t g = 0; g < G; ++g) {
            float* ag = acc.data() + g * D;
            for (int64_t d0 = 0; d0 < D; d0 += GS) {
              const float weight = p[g * BS + t] * KvRow<kv_t>::scale(vt, D, d0 / GS);
#pragma omp simd
              for (int64_t d = d0; d < d0 + GS; ++d) ag[d] += weight * widen(vt[d]);
            }
          }
        }
      }
      scalar_t* out_rows = o + (rows[r] * H + kv_head * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = len > 0 ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) out_rows[g * D + d] = narrow<scalar_t>(acc[g * D + d] * inv);
      }
    }
  });
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor token_idx,
                            double scale, bool rows_alone) {
  const RowsAlone alone(rows_alone);  // rows_alone: the rows are one request's, each sliced as its lone decode
  const auto dtype = query.scalar_type();
  const bool int8_kv = kv_cache.scalar_type() == torch::kInt8;
  TORCH_CHECK((dtype == kv_cache.scalar_type() || int8_kv) && dtype == out.scalar_type() &&
                  (dtype == torch::kFloat32 || dtype == torch::kBFloat16),
              "paged_decode_attention: query and out float32 or bfloat16, kv_cache the same or int8");
  TORCH_CHECK(kv_cache.size(4) == (int8_kv ? KvRow<int8_t>::width(query.size(2)) : query.size(2)),
              "paged_decode_attention: kv_cache rows must be head_dim wide (int8: and the packed scales)");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() &&
                  kv_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_decode_attention: contiguous tensors only (query: rows may be strided)");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0,
              "paged_decode_attention: num_heads must be a multiple of num_kv_heads");
  const float s = static_cast<float>(scale);
  if (dtype == torch::kFloat32) {
    if (int8_kv) decode<float, int8_t>(out, query, kv_cache, block_tables, seq_lens, token_idx, s);
    else decode<float, float>(out, query, kv_cache, block_tables, seq_lens, token_idx, s);
  } else {
    if (int8_kv) decode<c10::BFloat16, int8_t>(out, query, kv_cache, block_tables, seq_lens, token_idx, s);
    else decode<c10::BFloat16, c10::BFloat16>(out, query, kv_cache, block_tables, seq_lens, token_idx, s);
  }
}

// key, value [N, Hkv, D] float32 or bf16 (rows may be strided) -> their slots of an int8 pool
// [2, NB, BS, Hkv, width(D)]: each row quantized in the pass that stores it (kv_quant.quantize's bytes).
void write_kv_int8(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache, torch::Tensor slots) {
  const int64_t N = key.size(0), Hkv = key.size(1), D = key.size(2), W = kv_int8::width(D);
  TORCH_CHECK(kv_cache.scalar_type() == torch::kInt8 && kv_cache.is_contiguous() && kv_cache.size(3) == Hkv &&
                  kv_cache.size(4) == W && D <= 512,
              "write_kv_int8: a contiguous int8 pool of rows width(head_dim) wide, head_dim <= 512");
  TORCH_CHECK(value.sizes() == key.sizes() && value.scalar_type() == key.scalar_type() &&
                  (key.scalar_type() == torch::kFloat32 || key.scalar_type() == torch::kBFloat16),
              "write_kv_int8: key and value of one shape, float32 or bfloat16");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == D && value.stride(2) == 1 && value.stride(1) == D,
              "write_kv_int8: contiguous heads (rows may be strided)");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.size(0) == N,
              "write_kv_int8: int64 slot per token");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(0 <= slot[t] && slot[t] < num_slots, "write_kv_int8: slot out of range");
  int8_t* k_pool = kv_cache.data_ptr<int8_t>();
  int8_t* v_pool = k_pool + num_slots * Hkv * W;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T *k = static_cast<const T*>(key.data_ptr()), *v = static_cast<const T*>(value.data_ptr());
    const auto quantize = [D](const T* x, int8_t* row) {
      kv_int8::quantize_row(x, row, D, [](T value) { return widen(value); });
    };
    at::parallel_for(0, N * Hkv, std::max<int64_t>(1, 16384 / D), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / Hkv, h = i % Hkv, dst = (slot[t] * Hkv + h) * W;
        quantize(k + t * key.stride(0) + h * D, k_pool + dst);
        quantize(v + t * value.stride(0) + h * D, v_pool + dst);
      }
    });
  };
  if (key.scalar_type() == torch::kFloat32) run(0.f);
  else run(c10::BFloat16());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_int8", &write_kv_int8, "quantize K and V rows into their slots of an int8 pool (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention over the block pool (CPU)",
        py::arg("out"), py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("token_idx"), py::arg("scale"), py::arg("rows_alone") = false,
        py::call_guard<py::gil_scoped_release>());
}
