// What a one-block kernel's start costs after the bench's L2 flush, by parameter size and
// by code size, with no data to fetch: the question the 1 x 2048 rms backward left
// (notes/perf.md §29). There, warming the kernel's inputs in L2 did not move ours nor
// torch.compile's; warming its code (the same call on other rows after the flush) took
// about 0.4 us from both and left ours 0.14 us behind; with no flush they were level.
// Ours is 392 SASS with 96 bytes of parameters (c[0x0][0x210] to 0x26f), triton's 176 SASS
// reading 48 (0x210 to 0x23f, one 64-byte line of the constant bank).
//
// Three families of kernels, one block of 128 threads each:
//   param P: an empty kernel whose parameters are P bytes (it reads the first and the last
//     word), P = 8 .. 1024; 48 ends where triton's do, 96 where ours do;
//   code N: N steps of x = x * a + b on eight independent registers (-fmad=false: an FMUL
//     and an FADD each), so about 2N SASS executed once, straight-line; "skip" has the same
//     code behind a condition that is never true, so one taken branch jumps over it;
//   jumps J x M (below): J such branches in a row, each over M steps.
// Each is timed three ways: cold (after a 512 MiB memset, as micro_util.cuh's Timer and
// the bench do), code warm (after the memset, the same kernel once more, untimed), warm (no
// memset; a spin kernel without memory traffic hides the host instead). The slope of cold against N says what a SASS instruction costs to fetch from
// DRAM; compare it with (392 - 176) SASS and the 0.14-0.2 us gap.
// First run (H200, a594e62, bench/results/probes/launch_floor_a594e62.txt): parameters up
// to 256 B and the code's fetch cost nothing (code warm = cold); one taken branch over
// 1072 SASS cost about 0.2 us cold, which the jumps family takes apart.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -fmad=false -Ibackends/csrc \
//        bench/micro/launch_floor.cu -o /tmp/launch_floor && /tmp/launch_floor
//
// Prints a table (median us of 200 launches per mode). SASS per kernel (cuobjdump of this
// build, NOPs included): code N = 1, 64, 128, 256, 512, 1024: 48, 176, 304, 560, 1072,
// 2096 (the skip forms the same); param P: 24 each; jumps J x M = 1 x 64, 4 x 16, 4 x 64,
// 16 x 16, 16 x 64: 176, 192, 576, 616, 2152, with J taken branches each.
#include <cuda_runtime.h>

#include <cstdio>

#include "micro_util.cuh"

template <int P>
struct ParamBlock {
  unsigned w[P / 4];
};

__device__ int param_sink;  // not a parameter: the block is exactly P bytes

template <int P>
__global__ void param_kernel(ParamBlock<P> p) {
  // never true for the zero block launched; reads both ends of the parameters
  if ((p.w[0] ^ p.w[P / 4 - 1]) == 0xdeadbeefu && threadIdx.x == 0) param_sink = 1;
}

template <int N, bool SKIP>
__global__ void code_kernel(float a, float b, float* sink) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(threadIdx.x + i);
  if (!SKIP || a == 12345.0f) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i & 7] = x[i & 7] * a + b;
  }
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += x[i];
  if (s == 1234.5f) sink[threadIdx.x] = s;  // keeps the steps; never true here
}

// jumps J x M: J taken forward branches in a row, each over a block of M steps that is
// not executed (each block's condition names its own constant, so they stay apart), with
// one executed step between them: what a taken branch costs cold, the form of the one-row
// backward's branches (over the weight dtype's other path and the dweight store's other
// form; about four) that triton's straight-line kernel does not have (notes §30).
template <int J, int M>
__global__ void jumps_kernel(float a, float b, float* sink) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>(threadIdx.x + i);
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if (a == 12345.0f + static_cast<float>(j)) {
#pragma unroll
      for (int i = 0; i < M; ++i) x[i & 7] = x[i & 7] * a + b;
    }
    x[j & 7] = x[j & 7] + b;
  }
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += x[i];
  if (s == 1234.5f) sink[threadIdx.x] = s;  // keeps the blocks; never true here
}

enum class Mode { kCold, kCodeWarm, kWarm };
static const char* mode_name(Mode m) {
  return m == Mode::kCold ? "cold" : m == Mode::kCodeWarm ? "code warm" : "warm";
}

// (micro_util.cuh's spin_kernel, queued before the start event of a warm launch, hides
// the host's launch gap as the memset does for the flushed modes: without it, the first
// run's warm column timed the host, 5.5-6.9 us.)

// Median us of `launch` in `mode` (Timer flushes before every timed launch; warm skips the
// flush and spins instead).
template <typename F>
static float time_mode(Timer& timer, Mode mode, F launch) {
  const size_t bytes = timer.flush_bytes;
  float us;
  if (mode == Mode::kWarm) {
    timer.flush_bytes = 0;
    us = timer.median_us_after([] { spin_kernel<<<1, 32>>>(100000); }, launch, 200);
  } else {
    us = mode == Mode::kCodeWarm ? timer.median_us_after(launch, launch, 200)
                                 : timer.median_us(launch, 200);
  }
  timer.flush_bytes = bytes;
  return us;
}

// One table row: the label, then `launch`'s median us cold, code warm and warm.
template <typename F>
static void timed_row(Timer& timer, const char* label, F launch) {
  std::printf("%-22s", label);
  for (Mode m : {Mode::kCold, Mode::kCodeWarm, Mode::kWarm})
    std::printf(" %10.2f", time_mode(timer, m, launch));
  std::printf("\n");
}

template <int P>
static void param_row(Timer& timer) {
  ParamBlock<P> p{};
  char label[32];
  std::snprintf(label, sizeof label, "param %5d B", P);
  timed_row(timer, label, [&] { param_kernel<P><<<1, 128>>>(p); });
}

template <int N, bool SKIP>
static void code_row(Timer& timer, float* sink) {
  char label[32];
  std::snprintf(label, sizeof label, "code %5d steps%s", N, SKIP ? " skip" : "");
  timed_row(timer, label, [&] { code_kernel<N, SKIP><<<1, 128>>>(1.0f, 0.5f, sink); });
}

template <int J, int M>
static void jumps_row(Timer& timer, float* sink) {
  char label[32];
  std::snprintf(label, sizeof label, "jumps %3d x %3d steps", J, M);
  timed_row(timer, label, [&] { jumps_kernel<J, M><<<1, 128>>>(1.0f, 0.5f, sink); });
}

int main() {
  Timer timer;
  float* fsink = nullptr;
  CK(cudaMalloc(&fsink, 4096));
  std::printf("%-22s", "kernel (1 x 128)");
  for (Mode m : {Mode::kCold, Mode::kCodeWarm, Mode::kWarm}) std::printf(" %10s", mode_name(m));
  std::printf("   (median us)\n");
  param_row<8>(timer);
  param_row<48>(timer);
  param_row<64>(timer);
  param_row<96>(timer);
  param_row<128>(timer);
  param_row<256>(timer);
  param_row<1024>(timer);
  code_row<1, false>(timer, fsink);
  code_row<64, false>(timer, fsink);
  code_row<128, false>(timer, fsink);
  code_row<256, false>(timer, fsink);
  code_row<512, false>(timer, fsink);
  code_row<1024, false>(timer, fsink);
  code_row<512, true>(timer, fsink);
  code_row<1024, true>(timer, fsink);
  jumps_row<1, 64>(timer, fsink);
  jumps_row<4, 16>(timer, fsink);
  jumps_row<4, 64>(timer, fsink);
  jumps_row<16, 16>(timer, fsink);
  jumps_row<16, 64>(timer, fsink);
  CK(cudaDeviceSynchronize());
  return 0;
}
