// The sampler's random rows in one pass per row (sampling/sampler.py): temperature, top-k, top-p,
// min-p, then an exponential race on counter-based noise. A row's token is a pure function of
// its logits, its settings and its 64-bit key, whatever the batch.
//
// Race: token = argmax_v x_v - log(E_v), x = logits / temperature, E_v = -log(u_v) ~ Exp(1), the
// log of argmax_v p_v / E_v. u_v = ((h >> 9) + 0.5) / 2**23 with h = mix32(mix32(v ^ key_lo) ^ key_hi):
// the same integers, bit for bit, as sampling/noise.py. Logs are the vector logf of libmvec, within
// a few float32 ulps of torch's, so only a near-tie of two scores can pick another token than there.
// Filters (each off when its value is its identity, then no work is spent on it), in torch's order:
// top-k keeps x >= the k-th largest (a heap, no sort); top-p keeps the smallest prefix of the
// top-k-kept tokens by x descending whose probability reaches top_p (a bisection, then a sort of the
// few tokens at the cut); min-p keeps x - max >= log(min_p).
// A grammar's mask (bit v % 32 of int32 word v / 32 set: token v allowed) drops the others before the
// filters, and the race then visits only the words that allow something: a constrained row costs
// its allowed tokens, not the vocabulary.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kDropped = -INFINITY;
constexpr float kLowest = -87.f;  // e^x is a normal float32 above this
constexpr int64_t kSortedAtCut = 512;  // top-p sorts at most about this many tokens (more on ties)

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

inline float uniform(uint32_t v, uint32_t key_lo, uint32_t key_hi) {
  const uint32_t h = mix32(mix32(v ^ key_lo) ^ key_hi);
  return (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);  // exact: (0, 1)
}

// noise[v] = -log(u_v), Exp(1)
void exponential_row(float* noise, int64_t V, uint64_t key) {
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) noise[v] = -std::log(uniform(static_cast<uint32_t>(v), lo, hi));
}

// the largest x and its first index; 16 lanes so the loop vectorizes (a scalar max chains its latency)
struct Top {
  float value;
  int64_t index;
};

Top row_top(const float* x, int64_t V) {
  float lane[16];
  int64_t at[16];
  for (int i = 0; i < 16; ++i) lane[i] = -INFINITY, at[i] = 0;
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) {
#pragma omp simd
    for (int i = 0; i < 16; ++i) {
      const bool above = x[v + i] > lane[i];  // strict: a lane keeps its first index
      lane[i] = above ? x[v + i] : lane[i];
      at[i] = above ? v + i : at[i];
    }
  }
  Top top{-INFINITY, 0};
  for (int i = 0; i < 16; ++i)
    if (lane[i] > top.value || (lane[i] == top.value && at[i] < top.index)) top = {lane[i], at[i]};
  for (; v < V; ++v)
    if (x[v] > top.value) top = {x[v], v};
  return top;
}

float row_max(const float* x, int64_t V) { return row_top(x, V).value; }

// drops every x below the k-th largest (ties with it stay): one pass with a min-heap of the k largest
void top_k(float* x, int64_t V, int64_t k, std::vector<float>& heap) {
  heap.assign(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int64_t v = k; v < V; ++v) {
    if (x[v] <= heap.front()) continue;
    std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
    heap.back() = x[v];
    std::push_heap(heap.begin(), heap.end(), std::greater<float>());
  }
  const float kth = heap.front();
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) x[v] = x[v] < kth ? kDropped : x[v];
}

float mass_from(const float* x, const float* weight, int64_t V, float t) {  // the weight of x >= t
  float mass = 0.f;
#pragma omp simd reduction(+ : mass)
  for (int64_t v = 0; v < V; ++v) mass += x[v] >= t ? weight[v] : 0.f;
  return mass;
}

// keeps the smallest prefix (x descending, then index) whose mass reaches p: a token stays while the
// mass before it is below p, so the first always stays. Bisection on a threshold keeps mass(x >= lo)
// >= p * total > mass(x >= hi): every x >= hi stays, every x < lo goes, and only the few tokens in
// [lo, hi) are sorted. Weights below e^kLowest count as 0, hence the first lo.
void top_p(float* x, int64_t V, float p, float max_x, std::vector<float>& weight, std::vector<int32_t>& order) {
  weight.resize(V);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t v = 0; v < V; ++v) {  // exp of the clamped difference: no lane takes libmvec's slow path
    const float d = x[v] - max_x;
    weight[v] = d > kLowest ? std::exp(std::max(d, kLowest)) : 0.f;
    total += weight[v];
  }
  const float target = p * total;
  float lo = max_x + kLowest, hi = max_x + 1.f;
  for (int step = 0; step < 64; ++step) {
    const float low = lo, high = hi, mid = 0.5f * (lo + hi);  // locals: the loop vectorizes
    const float* w = weight.data();
    int64_t inside = 0;
    float mass = 0.f;  // of x >= mid
#pragma omp simd reduction(+ : inside, mass)
    for (int64_t v = 0; v < V; ++v) {
      inside += x[v] >= low && x[v] < high;
      mass += x[v] >= mid ? w[v] : 0.f;
    }
    if (inside <= kSortedAtCut || mid <= lo || mid >= hi) break;
    if (mass >= target) lo = mid; else hi = mid;
  }
  order.clear();
  for (int64_t v = 0; v < V; ++v)
    if (x[v] >= lo && x[v] < hi) order.push_back(static_cast<int32_t>(v));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  float before = mass_from(x, weight.data(), V, hi);
  for (int32_t v : order) {
    if (before >= target) x[v] = kDropped;
    before += weight[v];
  }
  const float low = lo;
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) x[v] = x[v] < low ? kDropped : x[v];
}

// >= e^y within 0.2% (2^(y log2 e), degree-4 Taylor of 2^f: low by < 0.17%, then the margin)
inline float exp_above(float y) {
  const float z = std::min(std::max(y * 1.44269504f, -126.f), 126.f);
  const float n = std::floor(z), f = z - n;
  const float p = 1.f + f * (0.6931472f + f * (0.2402265f + f * (0.0555041f + f * 0.0096181f)));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale * 1.002f;
}

// argmax_v x[v] / t - log(E_v), first index on ties (the noise is never stored). The largest x's
// score s is one the winner reaches, and E_v >= 1 - u_v, so v can reach s - kSlack only where
// 1 - u_v <= e^(x_v / t - s + kSlack): a chunk where no token can is skipped on its hash
// and one exp, the rest get the exact scores of the full race.
int64_t race(const float* x, float t, int64_t V, uint64_t key) {
  constexpr float kSlack = 0.01f;  // far above the logs' and x / t's rounding, in nats
  constexpr int64_t kChunk = 64;
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  const Top top = row_top(x, V);
  const bool prune = top.value > -1e30f;  // some token is not dropped
  const float inv_t = 1.f / t;
  const float reach = prune ? top.value / t - std::log(-std::log(uniform(static_cast<uint32_t>(top.index), lo, hi))) - kSlack
                            : 0.f;
  float best = -INFINITY, score[kChunk];
  int64_t at = 0;
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, V - c);
    int open = !prune;
#pragma omp simd reduction(| : open)
    for (int64_t i = 0; i < n; ++i)
      open |= 1.f - uniform(static_cast<uint32_t>(c + i), lo, hi) <= exp_above(x[c + i] * inv_t - reach);
    if (!open) continue;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float noise = -std::log(uniform(static_cast<uint32_t>(c + i), lo, hi));
      score[i] = x[c + i] / t - std::log(noise);
    }
    for (int64_t i = 0; i < n; ++i)
      if (score[i] > best) best = score[i], at = c + i;
  }
  return at;
}

inline uint32_t word_bits(const int32_t* mask, int64_t w, int64_t V) {  // bits past V cleared
  const uint32_t bits = static_cast<uint32_t>(mask[w]);
  const int64_t left = V - w * 32;
  return left >= 32 ? bits : bits & ((1u << left) - 1u);
}

// x[v] = -inf where the mask forbids v
void mask_row(float* x, const int32_t* mask, int64_t V) {
  for (int64_t w = 0; w * 32 < V; ++w) {
    const uint32_t bits = word_bits(mask, w, V);
    const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
    if (bits == 0xFFFFFFFFu) continue;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[base + j] = (bits >> j) & 1u ? x[base + j] : kDropped;
  }
}

// the race over the tokens the mask allows, a word of 32 at a time (the same lane arithmetic as
// race()); the first allowed token if all are at -inf, -1 if none is allowed
int64_t race_masked(const float* x, float t, const int32_t* mask, int64_t V, uint64_t key) {
  const uint32_t lo = static_cast<uint32_t>(key), hi = static_cast<uint32_t>(key >> 32);
  float best = -INFINITY, score[32];
  int64_t at = -1, first = -1;
  for (int64_t w = 0; w * 32 < V; ++w) {
    uint32_t bits = word_bits(mask, w, V);
    if (bits == 0) continue;
    const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const float noise = -std::log(uniform(static_cast<uint32_t>(base + j), lo, hi));
      score[j] = x[base + j] / t - std::log(noise);
    }
    if (first < 0) first = base + __builtin_ctz(bits);
    for (; bits != 0; bits &= bits - 1) {
      const int j = __builtin_ctz(bits);
      if (score[j] > best) best = score[j], at = base + j;
    }
  }
  return at >= 0 ? at : first;
}

}  // namespace

// logits [N, V] float32; temperature (> 0), top_p, min_p [N] float32; top_k, keys [N] int64;
// bitmask [N, ceil(V / 32)] int32 and masked [N] bool (a row's mask counts where masked), or both
// empty -> tokens [N]
torch::Tensor sample_masked_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k_,
                                 torch::Tensor top_p_, torch::Tensor min_p_, torch::Tensor keys, torch::Tensor bitmask,
                                 torch::Tensor masked_) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1,
              "sample_rows logits: [N, V] float32, contiguous rows");
  const int64_t N = logits.size(0), V = logits.size(1);
  const bool any_mask = masked_.numel() > 0;
  const auto masks = any_mask ? bitmask.to(torch::kInt).contiguous() : bitmask;
  const auto masked = any_mask ? masked_.to(torch::kBool).contiguous() : masked_;
  TORCH_CHECK(!any_mask || (masked.numel() == N && masks.dim() == 2 && masks.size(0) == N &&
                            masks.size(1) * 32 >= V), "sample_rows bitmask: [N, ceil(V / 32)] int32, masked [N]");
  auto f32 = [&](const torch::Tensor& t) { return t.to(torch::kFloat).contiguous(); };
  auto i64 = [&](const torch::Tensor& t) { return t.to(torch::kLong).contiguous(); };
  const auto temp = f32(temperature), tp = f32(top_p_), mp = f32(min_p_);
  const auto tk = i64(top_k_), key = i64(keys);
  TORCH_CHECK(temp.numel() == N && tp.numel() == N && mp.numel() == N && tk.numel() == N && key.numel() == N,
              "sample_rows: one setting of each kind per row");
  auto out = torch::empty({N}, torch::kLong);
  int64_t* tokens = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(V), scratch;
    std::vector<int32_t> order;
    for (int64_t n = begin; n < end; ++n) {
      const float* row = logits.data_ptr<float>() + n * logits.stride(0);
      const float t = temp.data_ptr<float>()[n];
      const uint64_t row_key = static_cast<uint64_t>(key.data_ptr<int64_t>()[n]);
      const int64_t k = tk.data_ptr<int64_t>()[n];
      const float p = tp.data_ptr<float>()[n], min_p = mp.data_ptr<float>()[n];
      const int32_t* mask = any_mask && masked.data_ptr<bool>()[n] ? masks.data_ptr<int32_t>() + n * masks.size(1)
                                                                    : nullptr;
      const bool filters = (k > 0 && k < V) || p < 1.f || min_p > 0.f;
      if (mask != nullptr && !filters) {  // the race reads the allowed tokens of the row
        const int64_t at = race_masked(row, t, mask, V, row_key);
        tokens[n] = at >= 0 ? at : race(row, t, V, row_key);
        continue;
      }
      if (!filters) {  // the race reads the row
        tokens[n] = race(row, t, V, row_key);
        continue;
      }
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) x[v] = row[v] / t;
      if (mask != nullptr) mask_row(x.data(), mask, V);
      if (k > 0 && k < V) top_k(x.data(), V, k, scratch);
      if (p < 1.f || min_p > 0.f) {
        const float max_x = row_max(x.data(), V);
        if (p < 1.f) top_p(x.data(), V, p, max_x, scratch, order);
        if (min_p > 0.f) {
          const float floor = max_x + std::log(min_p);
#pragma omp simd
          for (int64_t v = 0; v < V; ++v) x[v] = x[v] < floor ? kDropped : x[v];
        }
      }
      const int64_t at = mask != nullptr ? race_masked(x.data(), 1.f, mask, V, row_key) : -1;
      tokens[n] = at >= 0 ? at : race(x.data(), 1.f, V, row_key);
    }
  });
  return out;
}

torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k_, torch::Tensor top_p_,
                          torch::Tensor min_p_, torch::Tensor keys) {
  const auto none = torch::empty({0}, torch::kInt);
  return sample_masked_rows(logits, temperature, top_k_, top_p_, min_p_, keys, none, none.to(torch::kBool));
}

// logits [N, V] float32 (rows contiguous), bitmask [M, ceil(V / 32)] int32, rows [K] int64 (< N and < M):
// each listed row's forbidden tokens at -inf, in place
void mask_rows(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1,
              "mask_rows logits: [N, V] float32, contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt && bitmask.is_contiguous() &&
              bitmask.size(1) * 32 >= logits.size(1), "mask_rows bitmask: [M, ceil(V / 32)] int32, contiguous");
  const auto index = rows.to(torch::kLong).contiguous();
  const int64_t K = index.numel(), V = logits.size(1);
  const int64_t* at = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < K; ++i)
    TORCH_CHECK(at[i] >= 0 && at[i] < logits.size(0) && at[i] < bitmask.size(0), "mask_rows: row out of range");
  at::parallel_for(0, K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      mask_row(logits.data_ptr<float>() + at[i] * logits.stride(0), bitmask.data_ptr<int32_t>() + at[i] * bitmask.size(1),
               V);
  });
}

// keys [N] int64 -> [N, V] float32 Exp(1) noise, the race's (for tests against sampling/noise.py)
torch::Tensor exponential_noise(torch::Tensor keys, int64_t V) {
  const auto key = keys.to(torch::kLong).contiguous();
  auto out = torch::empty({key.numel(), V}, torch::kFloat);
  for (int64_t n = 0; n < key.numel(); ++n)
    exponential_row(out.data_ptr<float>() + n * V, V, static_cast<uint64_t>(key.data_ptr<int64_t>()[n]));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_rows", &sample_rows, "filters and an exponential race on counter-based noise, a row at a time",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_masked_rows", &sample_masked_rows, "sample_rows with a grammar's token bitmask on some rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("mask_rows", &mask_rows, "a grammar's token bitmask applied to some rows, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("exponential_noise", &exponential_noise, "the race's Exp(1) noise of each key over V tokens",
        py::call_guard<py::gil_scoped_release>());
}
