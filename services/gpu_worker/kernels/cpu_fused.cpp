// Fused element-wise ops for the CPU path, bf16 or float32: one pass over memory instead
// of torch's chain of ops (each reading and writing the whole tensor, each a dispatch).
//
// Every op reproduces, rounding for rounding, what the torch (and HF transformers) sequence
// computes: each intermediate that torch stores as bf16 is rounded to bf16 here too (round
// to nearest even); in float32 every op rounds as float32 arithmetic does. Products and
// sums are bit-identical; the RMS mean (sum order), SiLU's exp (another vector expf) and,
// in float32, products the compiler fuses into an FMA can move a result by one step (one
// bf16 step, or one float32 ulp). All tensors of a call share one dtype (bf16 or float32)
// and are contiguous in their last dimension; rows may be strided (views).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../attention/cpu_kv_int8.h"

namespace {

using bf16 = c10::BFloat16;

inline float from_bits(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(bf16 x) { return from_bits(x.x); }
inline uint16_t bits_of(float f) {  // round to nearest even (inputs here are never NaN)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float round_bf16(float f) {  // f as it reads back after being stored as bf16
  uint32_t u = static_cast<uint32_t>(bits_of(f)) << 16;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}
inline bf16 narrow(float f) { return bf16(bits_of(f), bf16::from_bits()); }

// T is bf16 or float: load widens to float, store narrows (round to nearest even), as_stored
// is what a float reads back as after a store to T
inline float load(bf16 x) { return widen(x); }
inline float load(float x) { return x; }
template <typename T> inline T store(float f);
template <> inline bf16 store<bf16>(float f) { return narrow(f); }
template <> inline float store<float>(float f) { return f; }
template <typename T> inline float as_stored(float f) { return std::is_same_v<T, bf16> ? round_bf16(f) : f; }

// rows per task: up to 64K elements (a decode step's norms and rotary) run on the calling thread,
// where a parallel region saves a few us and costs a stall whenever another process holds a core
inline int64_t grain_for(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elems)); }

// the dtype of the first tensor checked in a call: bf16 or float32; every other must match
bool check_dtype(const torch::Tensor& t, const char* name, const torch::Tensor& first) {
  TORCH_CHECK((first.scalar_type() == torch::kBFloat16 || first.scalar_type() == torch::kFloat) &&
                  t.scalar_type() == first.scalar_type() && t.stride(-1) == 1,
              name, ": bf16 or float32 (one dtype for every tensor), contiguous last dim");
  return first.scalar_type() == torch::kBFloat16;
}

// call f(T{}) with T the scalar type of the checked tensors
template <typename F>
void by_dtype(bool is_bf16, F&& f) {
  if (is_bf16) f(bf16{}); else f(float{});
}

// RMSNorm of one row of C: out = w * T(x * rsqrt(mean(x^2) + eps)) (HF LlamaRMSNorm)
template <typename T>
inline void norm_row(T* out, const float* x, const T* w, int64_t C, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += x[c] * x[c];
  const float inv = 1.f / std::sqrt(ss / C + eps);
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) out[c] = store<T>(load(w[c]) * as_stored<T>(x[c] * inv));
}

}  // namespace

// out [T, C] = rms_norm(x [T, C]) * weight [C]
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  const bool is_bf16 = check_dtype(x, "rms_norm x", x);
  check_dtype(out, "rms_norm out", x), check_dtype(weight, "rms_norm weight", x);
  const int64_t N = x.size(0), C = x.size(1);
  by_dtype(is_bf16, [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, N, grain_for(C), [&](int64_t begin, int64_t end) {
      std::vector<float> row(C);
      for (int64_t t = begin; t < end; ++t) {
        const T* xt = x.data_ptr<T>() + t * x.stride(0);
        for (int64_t c = 0; c < C; ++c) row[c] = load(xt[c]);
        norm_row(out.data_ptr<T>() + t * out.stride(0), row.data(), weight.data_ptr<T>(), C, eps);
      }
    });
  });
}

// residual [T, C] <- T(residual + x); out [T, C] = rms_norm(residual) * weight
void add_rms_norm(torch::Tensor out, torch::Tensor residual, torch::Tensor x, torch::Tensor weight, double eps) {
  const bool is_bf16 = check_dtype(x, "add_rms_norm x", x);
  check_dtype(out, "add_rms_norm out", x), check_dtype(residual, "add_rms_norm residual", x);
  check_dtype(weight, "add_rms_norm weight", x);
  const int64_t N = x.size(0), C = x.size(1);
  by_dtype(is_bf16, [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, N, grain_for(C), [&](int64_t begin, int64_t end) {
      std::vector<float> row(C);
      for (int64_t t = begin; t < end; ++t) {
        T* rt = residual.data_ptr<T>() + t * residual.stride(0);
        const T* xt = x.data_ptr<T>() + t * x.stride(0);
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          row[c] = as_stored<T>(load(rt[c]) + load(xt[c]));
          rt[c] = store<T>(row[c]);
        }
        norm_row(out.data_ptr<T>() + t * out.stride(0), row.data(), weight.data_ptr<T>(), C, eps);
      }
    });
  });
}

// out [T, I] = T(silu(gate)) * up, gate_up [T, 2I] = [gate | up]
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  const bool is_bf16 = check_dtype(gate_up, "silu_and_mul gate_up", gate_up);
  check_dtype(out, "silu_and_mul out", gate_up);
  const int64_t T = out.size(0), I = out.size(1);
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_and_mul: gate_up must be [T, 2 * I]");
  if (!is_bf16) {
    at::parallel_for(0, T, grain_for(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* g = gate_up.data_ptr<float>() + t * gate_up.stride(0);
        const float* u = g + I;
        float* o = out.data_ptr<float>() + t * out.stride(0);
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      }
    });
    return;
  }
  at::parallel_for(0, T, grain_for(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* g = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<bf16>() + t * gate_up.stride(0));
      const uint16_t* u = g + I;
      uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<bf16>() + t * out.stride(0));
      // raw bits in and out: the loop vectorises (with glibc's vector expf)
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = from_bits(g[i]);
        o[i] = bits_of(round_bf16(x / (1.f + std::exp(-x))) * from_bits(u[i]));
      }
    }
  });
}

namespace {

// cos/sin of one position, rounded to T as transformers does (c, s: half floats each)
template <typename T>
inline void angles_of(float* c, float* s, const torch::Tensor& cos, const torch::Tensor& sin, int64_t pos,
                      int64_t half) {
  const float* ct = cos.data_ptr<float>() + pos * half;
  const float* st = sin.data_ptr<float>() + pos * half;
  for (int64_t i = 0; i < half; ++i) c[i] = as_stored<T>(ct[i]), s[i] = as_stored<T>(st[i]);
}

// rotate `heads` contiguous head rows of 2 * half dims in place
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t half, const float* c, const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * 2 * half;
    T* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = load(x1[i]), b = load(x2[i]);
      x1[i] = store<T>(as_stored<T>(a * c[i]) - as_stored<T>(b * s[i]));
      x2[i] = store<T>(as_stored<T>(b * c[i]) + as_stored<T>(a * s[i]));
    }
  }
}

void check_rotary_args(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                       const torch::Tensor& first) {
  check_dtype(x, "rotary x", first);
  TORCH_CHECK(x.stride(1) == x.size(2), "rotary: heads must be contiguous");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos/sin float32, contiguous");
}

}  // namespace

// In place, x [T, heads, D] (row stride free, heads and D contiguous): dims i and i + D/2 of
// every head rotate by the angle of positions[t]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
// with cos/sin [max_pos, D/2] float32 rounded to bf16 first, as transformers does.
void rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
  check_rotary_args(x, cos, sin, x);
  const int64_t N = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  by_dtype(x.scalar_type() == torch::kBFloat16, [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, N, grain_for(heads * 2 * half), [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t t = begin; t < end; ++t) {
        angles_of<T>(c.data(), s.data(), cos, sin, pos[t], half);
        rotate_heads(x.data_ptr<T>() + t * x.stride(0), heads, half, c.data(), s.data());
      }
    });
  });
}

// One pass per token for the attention inputs: rotary on q [T, H, D] and k [T, Hkv, D] in
// place (as rotary() does), then k and v [T, Hkv, D] copied into their slot of the pool
// kv_cache [2, NB, BS, Hkv, D] (slot = block * BS + offset, as write_kv stores them); an int8 pool
// [2, NB, BS, Hkv, D + S] gets each row quantized as it is stored (kv_quant.quantize's bytes).
void rope_write_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions, torch::Tensor cos,
                   torch::Tensor sin, torch::Tensor kv_cache, torch::Tensor slots) {
  check_rotary_args(q, cos, sin, q), check_rotary_args(k, cos, sin, q), check_dtype(v, "rope_write_kv v", q);
  const bool int8_pool = kv_cache.scalar_type() == torch::kInt8;
  if (!int8_pool) check_dtype(kv_cache, "rope_write_kv kv_cache", q);
  TORCH_CHECK(kv_cache.is_contiguous() && v.stride(1) == v.size(2), "rope_write_kv: contiguous pool and v heads");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.size(0) == q.size(0), "rope_write_kv: int64 slot per token");
  const int64_t N = q.size(0), H = q.size(1), Hkv = k.size(1), half = q.size(2) / 2, D = 2 * half;
  const int64_t W = int8_pool ? kv_int8::width(D) : D;
  TORCH_CHECK(kv_cache.size(-1) == W && kv_cache.size(-2) == Hkv && D <= 512,
              "rope_write_kv: pool rows of head_dim (int8: head_dim and its scales, head_dim <= 512)");
  const int64_t row = Hkv * W;  // one token's K (or V) in the pool
  const int64_t plane = kv_cache.numel() / 2;
  const int64_t num_slots = plane / row;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(0 <= slot[t] && slot[t] < num_slots, "rope_write_kv: slot out of range");
  by_dtype(q.scalar_type() == torch::kBFloat16, [&](auto zero) {
    using T = decltype(zero);
    const auto store_rows = [&](int8_t* pool, int64_t t, const T* x) {  // one token's Hkv rows into its slot
      if (!int8_pool) return (void)std::memcpy(reinterpret_cast<T*>(pool) + slot[t] * row, x, row * sizeof(T));
      for (int64_t h = 0; h < Hkv; ++h)
        kv_int8::quantize_row(x + h * D, pool + slot[t] * row + h * W, D, [](T value) { return load(value); });
    };
    int8_t* k_pool = static_cast<int8_t*>(kv_cache.data_ptr());
    int8_t* v_pool = k_pool + plane * kv_cache.element_size();
    at::parallel_for(0, N, grain_for((H + 2 * Hkv) * 2 * half), [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t t = begin; t < end; ++t) {
        angles_of<T>(c.data(), s.data(), cos, sin, pos[t], half);
        rotate_heads(q.data_ptr<T>() + t * q.stride(0), H, half, c.data(), s.data());
        T* kt = k.data_ptr<T>() + t * k.stride(0);
        rotate_heads(kt, Hkv, half, c.data(), s.data());
        store_rows(k_pool, t, kt);
        store_rows(v_pool, t, v.data_ptr<T>() + t * v.stride(0));
      }
    });
  });
}

// [N] int64: the index of each row's maximum in logits [N, V] (the first one on ties, as
// torch.max(dim=1)), read in place from bf16 or float32: no float32 copy, one vector pass.
torch::Tensor argmax_rows(torch::Tensor logits) {
  const bool is_bf16 = check_dtype(logits, "argmax_rows logits", logits);
  const int64_t N = logits.size(0), V = logits.size(1);
  auto out = torch::empty({N}, torch::kInt64);
  int64_t* idx = out.data_ptr<int64_t>();
  by_dtype(is_bf16, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const T* row = logits.data_ptr<T>() + n * logits.stride(0);
        float best = -INFINITY;
#pragma omp simd reduction(max : best)
        for (int64_t v = 0; v < V; ++v) best = std::max(best, load(row[v]));
        int64_t at = 0;
        while (at < V - 1 && load(row[at]) != best) ++at;
        idx[n] = at;
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "row-wise argmax of bf16 or float32 logits",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm (bf16 or float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (bf16 or float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU activation (bf16 or float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, "rotary embedding in place (bf16 or float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_kv", &rope_write_kv, "rotary on q and k, k and v into their pool slots (bf16 or float32; the pool that or int8)",
        py::call_guard<py::gil_scoped_release>());
}
