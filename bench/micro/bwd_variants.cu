// Register-budget experiment for the pipelined backward (bf16, rms and fused
// 32768 x 2048, teams of 128 x 2): the shipped kernel (normspec_pipe.cuh) built
// with NORMSPEC_BWD_MIN_BLOCKS, the minimum resident 256-thread blocks its
// register budget must allow (1: no cap, 3: at most 85 registers), and dweight
// groups of 2**glog rows (glog 3 and 4: stacks of 24 or 32 KiB a block).
// Each binary prints, per case, microseconds (median of 30, each after a 512 MiB
// L2 flush), TB/s of the row traffic, registers, resident blocks per SM and an
// FNV-1a hash of dx (and dresidual) and the dweight workspace, which must be the
// same for every build of the same glog (same bits).
//
//   for b in 1 3; do nvcc -O3 -std=c++17 -arch=sm_90a -fmad=false \
//     -DNORMSPEC_BWD_MIN_BLOCKS=$b -Ibackends/csrc bench/micro/bwd_variants.cu \
//     -o /tmp/bwd_$b && /tmp/bwd_$b; done
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "micro_util.cuh"
#include "normspec_launch_impl.cuh"

using bf16 = __nv_bfloat16;
using namespace normspec;
using namespace normspec::launch_detail;

template <int OP>
static void run_case(const char* name, int glog, Timer& timer) {
  const long long rows = 32768, H = 2048;
  const size_t n = static_cast<size_t>(rows) * H;
  bf16 *x, *r, *dy, *dres, *dx, *d2;
  float *w, *ws;
  CK(cudaMalloc(&x, n * 2));
  CK(cudaMalloc(&r, n * 2));
  CK(cudaMalloc(&dy, n * 2));
  CK(cudaMalloc(&dres, n * 2));
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&d2, n * 2));
  CK(cudaMalloc(&w, H * 4));
  fill_bf16(x, n, 1);
  fill_bf16(r, n, 2);
  fill_bf16(dy, n, 3);
  fill_bf16(dres, n, 4);
  std::vector<float> hw(H);
  for (int i = 0; i < H; ++i) hw[i] = 0.01f * static_cast<float>((i * 37) % 101 - 50);
  CK(cudaMemcpy(w, hw.data(), H * 4, cudaMemcpyHostToDevice));

  BackwardPlan plan;
  plan.pipe = 1;
  plan.team_log = 7;
  plan.np = 2;
  plan.glog = glog;
  plan.groups = (rows + (1LL << glog) - 1) >> glog;
  CK(cudaMalloc(&ws, plan.groups * H * 4));
  LaunchArgs a;
  a.x = x;
  a.r = OP == OP_FUSED ? r : nullptr;
  a.dy = dy;
  a.dres = OP == OP_FUSED ? dres : nullptr;
  a.y = dx;
  a.y2 = OP == OP_FUSED ? d2 : nullptr;
  a.w = w;
  a.rows = rows;
  a.H = H;
  a.sx = a.sr = a.sdy = a.sdres = a.sy = a.sy2 = H;
  a.eps = 1e-6f;
  a.offset = 1.0f;
  a.flags = F_OFFSET | F_ALIGNED | (OP == OP_FUSED ? F_ROUNDED : 0);
  auto launch = [&] { backward_pipe_t<OP, bf16, 2>(a, ws, plan, 0); };
  launch();
  CK(cudaDeviceSynchronize());
  unsigned long long h = 1469598103934665603ull;
  h = fnv(dx, n * 2, h);
  if (OP == OP_FUSED) h = fnv(d2, n * 2, h);
  h = fnv(ws, plan.groups * H * 4, h);

  const float us = timer.median_us(launch, 30);
  const double bytes = (OP == OP_FUSED ? 6.0 : 3.0) * n * 2;
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, normspec_bwd_pipe_kernel<OP, bf16, 2>));
  PipeGeometry g;
  g.team_log = 7;
  g.np = 2;
  const size_t smem = pipe_stack_bytes(g, 8, glog) + pipe_weight_bytes(g, 8);
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, normspec_bwd_pipe_kernel<OP, bf16, 2>,
                                                   128, smem));
  std::printf("minb=%d  %-18s glog=%d %8.1f us %6.2f TB/s %4d regs %2d blocks/SM  "
              "hash %016llx\n",
              NORMSPEC_BWD_MIN_BLOCKS, name, glog, us,
              bytes / (us * 1e-6) / 1e12, fa.numRegs, per_sm, h);
  std::fflush(stdout);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(r), static_cast<void*>(dy),
                  static_cast<void*>(dres), static_cast<void*>(dx), static_cast<void*>(d2),
                  static_cast<void*>(w), static_cast<void*>(ws)})
    CK(cudaFree(p));
}

int main() {
  Timer timer;
  for (int glog : {3, 4}) {
    run_case<OP_RMS>("rms 32768x2048", glog, timer);
    run_case<OP_FUSED>("fused 32768x2048", glog, timer);
  }
  return 0;
}
