// Kernel-structure experiment for the forward norm (bf16, rms 32768 x 2048 and
// fused 32768 x 2048, q/k 524288 x 256): which way of keeping the memory system
// busy gets closest to a device-to-device copy? Every variant runs the same
// per-element arithmetic and reduction tree (the device functions of
// backends/csrc), so each output is compared bit for bit with the shipped
// pipelined kernel's; only the structure differs:
//
//   pipe      the shipped kernel: persistent teams, next row prefetched into
//             registers, weight factors in shared memory;
//   row       one row per team and no loop: as many teams resident as
//             registers allow, the GPU's block scheduler streams the rows;
//             weight factors read from global memory (L1 / L2 hits);
//   rowK      as row, K rows per team, all K rows' loads issued first.
//
// Build and run (on a GPU machine, from the repo root):
//   nvcc -O3 -std=c++17 -arch=sm_90a -fmad=false -Ibackends/csrc \
//        bench/micro/fwd_variants.cu -o /tmp/fwd_variants && /tmp/fwd_variants
// Prints one line per variant: microseconds (median of 40, each after a 512 MiB
// L2 flush, as triton's do_bench does), TB/s, % of the copy, and whether the
// output equals the shipped kernel's bit for bit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "micro_util.cuh"
#include "normspec_pipe.cuh"

using bf16 = __nv_bfloat16;
using namespace normspec;

template <bool LDCS>
__device__ __forceinline__ uint4 ld16(const bf16* p) {
  if constexpr (LDCS) return __ldcs(reinterpret_cast<const uint4*>(p));
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// K rows per team, one team = 2**TL threads (blocks of 256 threads for teams of
// <= 32 lanes, one team per block otherwise). H must be a multiple of 8 and
// NP * team * 8 >= H (full vectors only: this is a structure experiment).
template <int OP, int TL, int NP, int K, bool LDCS>
__global__ void __launch_bounds__(TL <= 5 ? 256 : (1 << TL))
    row_kernel(const bf16* __restrict__ x, const bf16* __restrict__ res,
               const float* __restrict__ w, bf16* __restrict__ y, bf16* __restrict__ y2,
               long long rows, int H, float eps, float offset, int flags) {
  constexpr int VEC = 8;
  constexpr bool TWO = OP == OP_FUSED;
  __shared__ float red[K][NP * 32];
  const long long gtid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = static_cast<int>(threadIdx.x) & ((1 << TL) - 1);
  const long long row0 = (gtid >> TL) * K;
  const int P = static_cast<int>(next_pow2(H));
  const int S = VEC << TL;
  const int tcol = lane * VEC;
  uint4 cx[K][NP], cr[K][NP];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const long long row = row0 + k;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const int col = p * S + tcol;
      cx[k][p] = make_uint4(0u, 0u, 0u, 0u);
      cr[k][p] = cx[k][p];
      if (row < rows && col < H) {
        cx[k][p] = ld16<LDCS>(x + row * H + col);
        if (TWO) cr[k][p] = ld16<LDCS>(res + row * H + col);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const long long row = row0 + k;
    const float rstd =
        row_rstd<OP, bf16, NP>(cx[k], cr[k], flags, tcol, S, H, P, eps, TL, red[k]);
    if (row < rows) {
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = p * S + tcol;
        if (col < H) {
          float v[VEC], out[VEC], g[VEC];
          norm_input_raw<OP, bf16>(cx[k][p], cr[k][p], flags, v);
          const float4 a = __ldg(reinterpret_cast<const float4*>(w + col));
          const float4 b = __ldg(reinterpret_cast<const float4*>(w + col + 4));
          const float gw[VEC] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
          for (int j = 0; j < VEC; ++j) g[j] = scale_weight(gw[j], flags & F_OFFSET, offset);
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] = mul(mul(v[j], rstd), g[j]);
          store_row<bf16>(y + row * H, col, H, out);
          if constexpr (OP == OP_FUSED) store_row<bf16>(y2 + row * H, col, H, v);
        }
      }
    }
  }
}

__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, long long n) {
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    __stcs(b + i, __ldcs(a + i));
}

struct Case {
  const char* name;
  int op;
  long long rows;
  int H;
};

struct Buffers {
  bf16 *x, *r, *y, *y2;
  float* w;
};

static Buffers make_buffers(const Case& c) {
  Buffers b;
  const size_t n = static_cast<size_t>(c.rows) * c.H;
  CK(cudaMalloc(&b.x, n * 2));
  CK(cudaMalloc(&b.r, n * 2));
  CK(cudaMalloc(&b.y, n * 2));
  CK(cudaMalloc(&b.y2, n * 2));
  CK(cudaMalloc(&b.w, c.H * 4));
  fill_bf16(b.x, n, 12345u);
  fill_bf16(b.r, n, 777u);
  std::vector<float> hw(c.H);
  for (int i = 0; i < c.H; ++i) hw[i] = 0.01f * static_cast<float>((i * 37) % 101 - 50);
  CK(cudaMemcpy(b.w, hw.data(), c.H * 4, cudaMemcpyHostToDevice));
  return b;
}

static std::vector<unsigned short> fetch(const bf16* p, size_t n) {
  std::vector<unsigned short> h(n);
  CK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

template <int OP, int NP>
static void launch_pipe(const Case& c, const Buffers& b, int team_log, bool persistent,
                        int flags, float eps, float offset) {
  auto kernel = normspec_fwd_pipe_kernel<OP, bf16, NP>;
  const int block = team_log <= 5 ? 256 : 1 << team_log;
  const int tpb = block >> team_log;
  const size_t smem = static_cast<size_t>(NP) * 8 * 4 << team_log;
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, smem));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long need = (c.rows + tpb - 1) / tpb;
  long long grid = persistent ? std::min<long long>(need, static_cast<long long>(per_sm) * sms)
                              : need;
  kernel<<<static_cast<unsigned>(grid), block, smem>>>(b.x, b.r, b.w, b.y, b.y2, c.rows, c.H,
                                                       c.H, c.H, c.H, c.H, eps, offset, flags,
                                                       team_log, nullptr);
}

template <int OP, int TL, int NP, int K, bool LDCS>
static void launch_row(const Case& c, const Buffers& b, int flags, float eps, float offset) {
  const int block = TL <= 5 ? 256 : 1 << TL;
  const long long teams = (c.rows + K - 1) / K;
  const long long grid = (teams * (1LL << TL) + block - 1) / block;
  row_kernel<OP, TL, NP, K, LDCS><<<static_cast<unsigned>(grid), block>>>(
      b.x, b.r, b.w, b.y, b.y2, c.rows, c.H, eps, offset, flags);
}

template <typename K>
static int regs_of(K kernel) {
  cudaFuncAttributes a;
  CK(cudaFuncGetAttributes(&a, kernel));
  return a.numRegs;
}

int main() {
  Timer tm;
  const float eps = 1e-6f, offset = 1.0f;
  const int flags = F_OFFSET | F_ALIGNED;
  std::printf("%-26s %-34s %8s %6s %5s %4s  %s\n", "case", "variant", "us", "TB/s", "copy%",
              "regs", "bits vs pipe");
  // copy bandwidth, same timing
  double copy_tbs = 0;
  {
    const long long n = 32768LL * 2048 * 2 / 16;
    uint4 *a, *bb;
    CK(cudaMalloc(&a, n * 16));
    CK(cudaMalloc(&bb, n * 16));
    CK(cudaMemset(a, 1, n * 16));
    const float us = tm.median_us([&] { copy_kernel<<<132 * 16, 256>>>(a, bb, n); });
    copy_tbs = 2.0 * n * 16 / (us * 1e-6) / 1e12;
    std::printf("%-26s %-34s %8.1f %6.2f %5s\n", "copy 256 MiB", "ldcs/stcs grid-stride", us,
                copy_tbs, "100");
    CK(cudaFree(a));
    CK(cudaFree(bb));
  }
  const Case cases[] = {{"rms 32768x2048", OP_RMS, 32768, 2048},
                        {"fused 32768x2048", OP_FUSED, 32768, 2048},
                        {"qk 524288x256", OP_RMS, 524288, 256}};
  for (const Case& c : cases) {
    Buffers b = make_buffers(c);
    const size_t n = static_cast<size_t>(c.rows) * c.H;
    const double bytes = (c.op == OP_FUSED ? 4.0 : 2.0) * n * 2;
    std::vector<unsigned short> ref, ref2;
    auto report = [&](const char* variant, int regs, auto launch) {
      CK(cudaMemset(b.y, 0xff, n * 2));
      launch();
      CK(cudaDeviceSynchronize());
      const bool first = ref.empty();
      std::vector<unsigned short> out = fetch(b.y, n);
      std::vector<unsigned short> out2 = c.op == OP_FUSED ? fetch(b.y2, n) : out;
      if (first) {
        ref = out;
        ref2 = out2;
      }
      const bool same = out == ref && out2 == ref2;
      const float us = tm.median_us(launch);
      const double tbs = bytes / (us * 1e-6) / 1e12;
      std::printf("%-26s %-34s %8.1f %6.2f %5.1f %4d  %s\n", c.name, variant, us, tbs,
                  100.0 * tbs / copy_tbs, regs, first ? "(reference)" : (same ? "equal" : "DIFFERENT"));
      std::fflush(stdout);
    };
#define PIPE(OPV, NPV, TLV, PERS, NAME)                                                  \
  report(NAME, regs_of(normspec_fwd_pipe_kernel<OPV, bf16, NPV>),                         \
         [&] { launch_pipe<OPV, NPV>(c, b, TLV, PERS, flags, eps, offset); })
#define ROW(OPV, TLV, NPV, KV, LD, NAME)                                                  \
  report(NAME, regs_of(row_kernel<OPV, TLV, NPV, KV, LD>),                                \
         [&] { launch_row<OPV, TLV, NPV, KV, LD>(c, b, flags, eps, offset); })
    if (c.op == OP_RMS && c.H == 2048) {
      PIPE(OP_RMS, 2, 7, true, "pipe 128x2 persistent (shipped)");
      PIPE(OP_RMS, 2, 7, false, "pipe 128x2 one row per team");
      ROW(OP_RMS, 7, 2, 1, true, "row 128x2 K1 ldcs");
      ROW(OP_RMS, 7, 2, 1, false, "row 128x2 K1 ldg");
      ROW(OP_RMS, 8, 1, 1, true, "row 256x1 K1 ldcs");
      ROW(OP_RMS, 6, 4, 1, true, "row 64x4 K1 ldcs");
      ROW(OP_RMS, 5, 8, 1, true, "row 32x8 K1 ldcs");
      ROW(OP_RMS, 7, 2, 2, true, "row 128x2 K2 ldcs");
      ROW(OP_RMS, 8, 1, 2, true, "row 256x1 K2 ldcs");
      ROW(OP_RMS, 8, 1, 4, true, "row 256x1 K4 ldcs");
      ROW(OP_RMS, 6, 4, 2, true, "row 64x4 K2 ldcs");
    } else if (c.op == OP_FUSED) {
      PIPE(OP_FUSED, 2, 7, true, "pipe 128x2 persistent (shipped)");
      ROW(OP_FUSED, 7, 2, 1, true, "row 128x2 K1 ldcs");
      ROW(OP_FUSED, 8, 1, 1, true, "row 256x1 K1 ldcs");
      ROW(OP_FUSED, 6, 4, 1, true, "row 64x4 K1 ldcs");
      ROW(OP_FUSED, 8, 1, 2, true, "row 256x1 K2 ldcs");
      ROW(OP_FUSED, 7, 2, 2, true, "row 128x2 K2 ldcs");
    } else {
      PIPE(OP_RMS, 2, 4, true, "pipe 16x2 persistent (shipped)");
      ROW(OP_RMS, 4, 2, 1, true, "row 16x2 K1 ldcs");
      ROW(OP_RMS, 5, 1, 1, true, "row 32x1 K1 ldcs");
      ROW(OP_RMS, 3, 4, 1, true, "row 8x4 K1 ldcs");
      ROW(OP_RMS, 5, 1, 2, true, "row 32x1 K2 ldcs");
      ROW(OP_RMS, 4, 2, 2, true, "row 16x2 K2 ldcs");
      ROW(OP_RMS, 5, 1, 4, true, "row 32x1 K4 ldcs");
    }
#undef PIPE
#undef ROW
    CK(cudaFree(b.x));
    CK(cudaFree(b.r));
    CK(cudaFree(b.y));
    CK(cudaFree(b.y2));
    CK(cudaFree(b.w));
  }
  return 0;
}
