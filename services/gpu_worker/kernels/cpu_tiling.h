// The few-row linears' shared loops (cpu_gemv.cpp, cpu_gemv_f32.cpp): the row count as a
// template argument, and tiles of 16-output blocks spread over the threads.
// cpu_extensions hashes this file onto both extensions' compile lines (HEADERS).
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

// f(std::integral_constant<int, M>) for M in 1..8 (both kernels' most rows a call)
template <typename F>
void by_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// tiles of NB 16-output blocks over [0, num_blocks), spread over the threads: tile(b0) for a
// whole tile, tail(b) for each block of the last, short one. A task streams at least ~4 KiB
// of weight per k (bytes_per_block * NB per tile), so a small projection stays on one thread.
template <int NB, typename Tile, typename Tail>
void over_tiles(int64_t num_blocks, int64_t bytes_per_block, Tile&& tile, Tail&& tail) {
  const int64_t num_tiles = (num_blocks + NB - 1) / NB;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, bytes_per_block * NB));
  at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * NB;
      if (num_blocks - b0 >= NB) {
        tile(b0);
      } else {
        for (int64_t b = b0; b < num_blocks; ++b) tail(b);
      }
    }
  });
}

}  // namespace
