// Shared helpers of the bench/micro experiments: error checks and test data.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                           \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// n bf16 values in (-4, 4) (random sign and mantissa, exponents 125..128) from
// a linear congruential generator seeded with `seed`, copied to d.
inline void fill_bf16(__nv_bfloat16* d, size_t n, unsigned seed) {
  std::vector<unsigned short> h(n);
  unsigned s = seed;
  for (auto& v : h) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<unsigned short>(((s >> 31) << 15) | ((125u + ((s >> 20) & 3u)) << 7) |
                                    ((s >> 8) & 0x7fu));
  }
  CK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
}

// A new device buffer of n bf16 values, filled by fill_bf16(seed) unless seed is 0.
inline __nv_bfloat16* new_bf16(size_t n, unsigned seed = 0) {
  __nv_bfloat16* d = nullptr;
  CK(cudaMalloc(&d, n * 2));
  if (seed != 0) fill_bf16(d, n, seed);
  return d;
}

// FNV-1a hash of `bytes` of device memory at d, continuing from h (start with
// 1469598103934665603): outputs of two builds compare by their hashes.
inline unsigned long long fnv(const void* d, size_t bytes, unsigned long long h) {
  std::vector<unsigned char> b(bytes);
  CK(cudaMemcpy(b.data(), d, bytes, cudaMemcpyDeviceToHost));
  for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Keeps the GPU busy for about `cycles` clocks without touching memory: queued before a
// timed launch, it hides the host's launch gap where no long flush does.
__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Median microseconds of `launch` over `reps` runs, each after a 512 MiB memset
// (which leaves L2 full of dirty lines, as triton's do_bench does), after 5 warm-ups.
// flush_bytes = 0 (set after construction) times without the memset. spin_cycles > 0
// queues a spin kernel of that many cycles after the flush, before the start event.
// NORMSPEC_AB_FLUSH_MIB=<1..512> (run time) sets a smaller flush and a spin of 200000
// cycles (about 0.1 ms): with 1 MiB the launch's data and code stay in L2 (warm), as in
// bench/run.py --flush-mib 1 (notes/perf.md §32). It applies to every Timer of the
// harness (launch_floor's "cold" column too); leave it unset for the harnesses' own modes.
struct Timer {
  void* flush = nullptr;
  size_t flush_bytes = 512ull << 20;
  long long spin_cycles = 0;
  cudaEvent_t e0, e1;
  Timer() {
    CK(cudaMalloc(&flush, flush_bytes));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    if (const char* s = std::getenv("NORMSPEC_AB_FLUSH_MIB")) {
      char* end = nullptr;
      const long mib = std::strtol(s, &end, 10);
      if (end == s || *end != '\0' || mib < 1 || mib > 512) {
        std::fprintf(stderr, "NORMSPEC_AB_FLUSH_MIB: expected 1..512, got %s\n", s);
        std::exit(2);
      }
      flush_bytes = static_cast<size_t>(mib) << 20;
      spin_cycles = 200000;
    }
  }
  template <typename F>
  float median_us(F launch, int reps = 40) {
    return median_us_after([] {}, launch, reps);
  }
  // The same, with `before` run (untimed) after each flush and before `launch`.
  template <typename B, typename F>
  float median_us_after(B before, F launch, int reps = 40) {
    for (int i = 0; i < 5; ++i) launch();
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      if (flush_bytes != 0) CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
      before();
      if (spin_cycles > 0) spin_kernel<<<1, 32>>>(spin_cycles);
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.0f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};
