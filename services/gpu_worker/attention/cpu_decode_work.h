// cpu_decode.cpp's shared pieces: the float32 widening of the storage type, the work queue
// that hands out (slices of) requests, the slices' partial results and their merge, and the
// online-softmax block update. One translation unit includes it (cpu_extensions rebuilds the
// extension when a header changes: its hash is on the compile line).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu_kv_int8.h"

namespace {

constexpr float kNoScore = -1e30f;  // finite "minus infinity": exp(kNoScore - x) == 0

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float widen(int8_t x) { return static_cast<float>(x); }

template <typename T>
inline T narrow(float x) { return static_cast<T>(x); }  // BFloat16: round to nearest even

// A pool row of one (token, KV head): D values of kv_t. An int8 row (kv_quant.py) is quantized
// in groups of group(D) values (32 where D allows), each group's scale 12 bits (float32's bits
// 19-30), two packed in 3 bytes after the values. Unquantized rows: one group, scale 1.
template <typename kv_t>
struct KvRow {
  static constexpr bool kQuantized = false;
  static constexpr int64_t group(int64_t D) { return D; }
  static constexpr int64_t width(int64_t D) { return D; }
  static float scale(const kv_t*, int64_t, int64_t) { return 1.f; }
};

template <>
struct KvRow<int8_t> {
  static constexpr bool kQuantized = true;
  static constexpr int64_t group(int64_t D) { return kv_int8::group(D); }
  static constexpr int64_t width(int64_t D) { return kv_int8::width(D); }
  static float scale(const int8_t* row, int64_t D, int64_t g) { return kv_int8::scale(row, D, g); }
};

// The step's work, longest first, taken one item at a time by whichever thread is free (a
// static split stalls the batch behind a thread that lost its shared core).
// An item is blocks [begin, end) of request r. With fewer requests than threads each long
// enough request is sliced, one slice per thread: a slice leaves its unnormalised (acc, m, l)
// in Partials (part >= 0), merged once every thread is done. part < 0: the whole request,
// written to out by the thread that computed it.
struct WorkItem {
  int64_t r, begin, end, part;
};

struct Split {
  int64_t r, first_part, num_parts;
};

constexpr int64_t kMinSliceBlocks = 4;  // a shorter slice costs more to merge than it saves

// Set (RowsAlone) while a call's rows are one request's verification rows: each row is sliced as
// a lone decode of it would be, so its sums are that decode's whatever the row count. Read on the
// calling thread, where the WorkQueue is built.
inline thread_local bool tls_rows_alone = false;

struct RowsAlone {
  explicit RowsAlone(bool on) : before_(tls_rows_alone) { tls_rows_alone = on; }
  ~RowsAlone() { tls_rows_alone = before_; }
  bool before_;
};

class WorkQueue {
 public:
  WorkQueue(const int32_t* lens, int64_t num_reqs, int64_t BS) {
    std::vector<int64_t> order(num_reqs);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [lens](int64_t a, int64_t b) { return lens[a] > lens[b]; });
    const int64_t num_threads = at::get_num_threads();
    for (int64_t r : order) {
      const int64_t num_blocks = (lens[r] + BS - 1) / BS;
      const bool sliced = num_reqs < num_threads || tls_rows_alone;
      const int64_t num_slices = sliced ? std::min(num_threads, num_blocks / kMinSliceBlocks) : 1;
      if (num_slices <= 1) {
        items_.push_back({r, 0, num_blocks, -1});
        continue;
      }
      splits_.push_back({r, num_parts_, num_slices});
      for (int64_t s = 0; s < num_slices; ++s)
        items_.push_back({r, num_blocks * s / num_slices, num_blocks * (s + 1) / num_slices, num_parts_++});
    }
  }
  // the next item into `item`; false once all are taken
  bool next(WorkItem& item) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= static_cast<int64_t>(items_.size())) return false;
    item = items_[i];
    return true;
  }
  int64_t num_parts() const { return num_parts_; }
  const std::vector<Split>& splits() const { return splits_; }

 private:
  std::vector<WorkItem> items_;
  std::vector<Split> splits_;
  int64_t num_parts_ = 0;
  std::atomic<int64_t> next_{0};
};

// The slices' partial results: per part, acc [H, D] (unnormalised, natural element order),
// m [H] and l [H]; merge() writes each split request's rows of out as one pass would have:
// out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s.
class Partials {
 public:
  Partials(int64_t num_parts, int64_t H, int64_t D) : H_(H), D_(D), acc_(num_parts * H * D), m_(num_parts * H),
                                                       l_(num_parts * H) {}
  float* acc(int64_t part) { return acc_.data() + part * H_ * D_; }
  void store_ml(int64_t part, const std::vector<float>& m, const std::vector<float>& l) {
    std::copy(m.begin(), m.end(), m_.begin() + part * H_);
    std::copy(l.begin(), l.end(), l_.begin() + part * H_);
  }
  // A work item's end: a slice's unnormalised (acc, m, l) into its part, a whole request's rows
  // (acc / l, H * D from out_rows) into out
  template <typename scalar_t>
  void finish(const WorkItem& item, const std::vector<float>& acc, const std::vector<float>& m,
              const std::vector<float>& l, scalar_t* out_rows) {
    if (item.part >= 0) {
      std::copy(acc.begin(), acc.end(), this->acc(item.part));
      store_ml(item.part, m, l);
      return;
    }
    for (int64_t j = 0; j < H_; ++j) {
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
      for (int64_t d = 0; d < D_; ++d) out_rows[j * D_ + d] = narrow<scalar_t>(acc[j * D_ + d] * inv);
    }
  }
  template <typename scalar_t>
  void merge(const WorkQueue& queue, scalar_t* o, const int64_t* rows) const {
    std::vector<float> weight;
    for (const Split& split : queue.splits()) {
      weight.resize(split.num_parts);
      scalar_t* out_rows = o + rows[split.r] * H_ * D_;
      for (int64_t j = 0; j < H_; ++j) {
        float max_m = kNoScore, sum_l = 0.f;
        for (int64_t s = 0; s < split.num_parts; ++s) max_m = std::max(max_m, m_[(split.first_part + s) * H_ + j]);
        for (int64_t s = 0; s < split.num_parts; ++s) {
          const int64_t part = split.first_part + s;
          weight[s] = std::exp(m_[part * H_ + j] - max_m);
          sum_l += weight[s] * l_[part * H_ + j];
        }
        for (int64_t d = 0; d < D_; ++d) {
          float sum = 0.f;
          for (int64_t s = 0; s < split.num_parts; ++s)
            sum += weight[s] * acc_[((split.first_part + s) * H_ + j) * D_ + d];
          out_rows[j * D_ + d] = narrow<scalar_t>(sum / sum_l);
        }
      }
    }
  }

 private:
  int64_t H_, D_;
  std::vector<float> acc_, m_, l_;
};

// A work item's start: acc and l zero, m no score
inline void reset_item(std::vector<float>& acc, std::vector<float>& m, std::vector<float>& l) {
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(m.begin(), m.end(), kNoScore);
  std::fill(l.begin(), l.end(), 0.f);
}

// A block's K and V (bytes each) into L1 while the one before is computed: a request's blocks
// lie anywhere in the pool, which the hardware prefetcher cannot guess
inline void prefetch_block(const void* k, const void* v, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(static_cast<const char*>(k) + off, 0, 3);
    __builtin_prefetch(static_cast<const char*>(v) + off, 0, 3);
  }
}

// The next block's K and V into L1 a few lines per step of the current block's walk, done two
// thirds of the way through it: a block's lines at once (prefetch_block) fill the miss buffers
// and stall the loads that follow. steps: ahead() calls in a block's walk.
class BlockPrefetch {
 public:
  void start(const void* k, const void* v, int64_t bytes, int64_t steps) {
    k_ = static_cast<const char*>(k), v_ = static_cast<const char*>(v), bytes_ = bytes, off_ = 0;
    const int64_t lines = (bytes + 63) / 64;
    per_step_ = std::max<int64_t>(1, (3 * lines + 2 * steps - 1) / (2 * steps));
  }
  void ahead() {
    for (const int64_t end = std::min(bytes_, off_ + 64 * per_step_); off_ < end; off_ += 64) {
      __builtin_prefetch(k_ + off_, 0, 3);
      __builtin_prefetch(v_ + off_, 0, 3);
    }
  }

 private:
  const char *k_ = nullptr, *v_ = nullptr;
  int64_t bytes_ = 0, off_ = 0, per_step_ = 1;
};

// Runs body() once on each of at::get_num_threads() threads; body drains a WorkQueue.
template <typename F>
inline void on_every_thread(const F& body) {
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { body(); });
}

// One block of the online softmax for one head: scores p[0, n) become exp(p - m') where
// m' = max(m, max p); m and l (the running sum of exp) are updated to m'; returns the factor
// exp(m - m') by which the head's accumulated output must be rescaled.
inline float softmax_block(float* p, int64_t n, float& m, float& l) {
  float block_max = kNoScore;
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, p[t]);
  const float new_m = std::max(m, block_max);
  const float correction = std::exp(m - new_m);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    p[t] = std::exp(p[t] - new_m);
    sum += p[t];
  }
  m = new_m;
  l = l * correction + sum;
  return correction;
}

}  // namespace
