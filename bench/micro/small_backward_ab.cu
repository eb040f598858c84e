// Where the few-row backward's time goes (bf16 rows of 2048, a bf16 weight, the
// forward's saved rstd: the bench's torch extension case). The full bench at 604d92a put
// the 1-row backward, one kernel since F_DW_FINAL, at 8.0 us of device time against
// torch.compile's 4.5 and a same-bytes copy's 4.3; its kernel has 872 SASS instructions
// (the forward's constant form 640, at 4.7 us).
//
// Two sets of lines:
//   floor: an empty kernel of one 256-thread block with 0 .. 100 KiB of dynamic shared
//     memory, each launch after the flush. If the floor rises with the shared memory,
//     part of the backward's time is the multiprocessors' shared-memory / L1
//     reconfiguration after the flush's kernel, not the backward's work; "carveout"
//     repeats the 8 KiB launch with cudaFuncAttributePreferredSharedMemoryCarveout at
//     0 (most L1) and 100 (most shared memory).
//   norm: the shipped launcher (launch_forward, then launch_backward and dweight's
//     tree launches as normspec_cuda.cpp's backward() makes them) at 1, 64 and 4096
//     rows of 2048 and 64 and 4096 of 256 (the q/k norm), with an FNV-1a hash of dx,
//     dweight and y (equal across settings; y since session 30).
// The NORMSPEC_* switches of the launcher apply (NORMSPEC_DW_FINAL=0, NORMSPEC_PDL=0), and
// where the tree has them, the build-time ones of the backward kernel (compile with
// -DNORMSPEC_BWD_FILL_BATCHED=0 or -DNORMSPEC_RMS_BWD_UNCAPPED=0 for the old forms).
// -DNORMSPEC_BLOCK_FOLD_LOCAL=0 -DNORMSPEC_FWD_ROW_PER_BLOCK=0: the multi-warp teams' fold
// by shuffles and the one-row forward's row from the thread index, as before session 29
// (scripts/gpu_evidence.sh block-fold times them against the default; notes §34).
// -DNORMSPEC_FWD_ROW_SLOT32=0: the one-row forward's 64-bit row index, as before session
// 30; -DNORMSPEC_TEAM_SKIP_BROADCAST=1: the warp teams without their final broadcast (an
// experiment; gpu_evidence.sh warp-team times both against the default; notes §35).
// 32768 rows: the rms backward of the bench's large shape (its 128 x 2 saved-rstd form).
// NORMSPEC_AB_GATED=1 adds the gated norm's 2^21 x 128 in both conventions (silu, the
// bench's shape; its hash covers y and dgate too), and 2^20 x 256 in the vllm one.
// NORMSPEC_AB_ROWS=8,1000 adds the rms norm of 8 and of 1000 rows of 2048.
// Build with the extension's CUDA sources and run:
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -fmad=false -Ibackends/csrc \
//        bench/micro/small_backward_ab.cu backends/csrc/normspec_launch.cu \
//        backends/csrc/launch_units/*.cu -o /tmp/small_bwd && /tmp/small_bwd default
//
// (bench/micro/ab.py --launch-units compiles the units side by side instead.)
//
// Medians of 40 launches, each after a 512 MiB memset (micro_util.cuh's Timer).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "micro_util.cuh"
#include "normspec_arith.h"
#include "normspec_launch.h"

using bf16 = __nv_bfloat16;
using namespace normspec;

// The weight widened to fp32: the launcher reads it where a switch (NORMSPEC_FWD_TEAM=8 at
// 2048 columns, say) sends a call to a kernel that does not read the bf16 weight as it is,
// as the torch extension passes it then (weight_fp32_unless_as_is); without it that launch
// fails with cudaErrorInvalidValue.
__global__ void widen_kernel(const bf16* w, float* w32, long long n) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) w32[i] = __bfloat162float(w[i]);
}

__global__ void empty_kernel(int* sink) {
  extern __shared__ int smem_any[];
  if (sink != nullptr && threadIdx.x == 0) sink[blockIdx.x] = smem_any[0];
}

static void floor_case(const char* label, const char* name, size_t smem, int carveout,
                       Timer& timer) {
  if (smem > 48 * 1024)
    CK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            static_cast<int>(smem)));
  CK(cudaFuncSetAttribute(empty_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                          carveout));
  const float us = timer.median_us([&] { empty_kernel<<<1, 256, smem>>>(nullptr); });
  std::printf("%-12s %-28s %6zu B smem %9.2f us\n", label, name, smem, us);
}

// The torch extension's backward() (normspec_cuda.cpp) for `op`, bf16 weight, saved rstd.
static void backward(int op, LaunchArgs a, bf16* dweight, float* ws, float* ws2) {
  const int sms = current_device_sms();
  const BackwardPlan plan = backward_plan_for(DT_BF16, a, sms);
  if (writes_dweight_final(DT_BF16, DT_BF16, plan)) {
    a.flags |= F_DW_FINAL;
    CK(launch_backward(op, DT_BF16, a, reinterpret_cast<float*>(dweight), plan, nullptr));
    return;
  }
  long long G = plan.groups;
  const long long last_max = col_tree_last_rows();
  if (chained_launches(nullptr)) a.flags |= F_LET_DEPENDENTS;
  CK(launch_backward(op, DT_BF16, a, ws, plan, nullptr));
  float* in = ws;
  float* out = ws2;
  while (G > (last_max > 0 ? last_max : 1)) {
    const long long gout = col_tree_rows_out(G);
    CK(launch_col_tree(in, out, G, a.H, nullptr));
    std::swap(in, out);
    G = gout;
  }
  // (NORMSPEC_TREE_LAST=0 would cast with .to() in the extension: not mirrored here)
  CK(launch_col_tree_last(in, dweight, DT_BF16, G, a.H, nullptr));
}

// OP_RMS (the zero-centred norm) or OP_GATED (silu; `flags` may add F_HF), as the
// bench times them.
// NORMSPEC_AB_GATED=1 (run time): also the GDN norm's 2^21 x 128, both conventions, and
// 2^20 x 256 (vllm) (fwd and bwd; the bwd includes dgate).
static bool gated_cases_on() {
  const char* s = std::getenv("NORMSPEC_AB_GATED");
  return s != nullptr && s[0] == '1' && s[1] == '\0';
}

// NORMSPEC_AB_ROWS=<n>,<n>,... (run time): also the rms norm of that many rows of 2048.
static std::vector<long long> extra_rows() {
  std::vector<long long> rows;
  const char* s = std::getenv("NORMSPEC_AB_ROWS");
  while (s != nullptr && *s != '\0') {
    char* end = nullptr;
    const long long n = std::strtoll(s, &end, 10);
    if (end == s || n <= 0) {
      std::fprintf(stderr, "NORMSPEC_AB_ROWS: expected positive row counts, got '%s'\n", s);
      std::exit(2);
    }
    rows.push_back(n);
    s = *end == ',' ? end + 1 : end;
  }
  return rows;
}

static void norm_case(const char* label, const char* name, int op, long long rows, long long H,
                      Timer& timer, int flags = 0) {
  const size_t n = static_cast<size_t>(rows) * H;
  const bool gated = op == OP_GATED;
  bf16 *x = new_bf16(n, 1), *dy = new_bf16(n, 2), *w = new_bf16(H, 5);
  bf16 *y = new_bf16(n), *dx = new_bf16(n), *dw = new_bf16(H);
  bf16 *gate = gated ? new_bf16(n, 3) : nullptr, *dgate = gated ? new_bf16(n) : nullptr;
  float *rstd, *ws, *ws2, *w32;
  CK(cudaMalloc(&w32, H * 4));
  widen_kernel<<<static_cast<unsigned>((H + 255) / 256), 256>>>(w, w32, H);
  CK(cudaGetLastError());
  CK(cudaMalloc(&rstd, rows * 4));
  CK(cudaMalloc(&ws, n * 4));  // at most one workspace row per input row
  CK(cudaMalloc(&ws2, n * 4));
  LaunchArgs a;
  a.x = x;
  a.r = gate;
  a.w_in_dtype = w;
  a.w = w32;  // read only where the launcher does not take w_in_dtype
  a.rows = rows;
  a.H = H;
  a.sx = a.sr = a.sy = a.sy2 = a.sdy = H;
  a.eps = 1e-6f;
  a.offset = gated ? 0.0f : 1.0f;
  a.flags = (gated ? 0 : F_OFFSET) | F_W_IS_INPUT | flags;
  LaunchArgs f = a;
  f.y = y;
  f.rstd_out = rstd;
  const float fwd_us = timer.median_us([&] { CK(launch_forward(op, DT_BF16, f, nullptr)); });
  LaunchArgs b = a;
  b.dy = dy;
  b.y = dx;
  b.y2 = dgate;
  b.rstd_in = rstd;
  const float bwd_us = timer.median_us([&] { backward(op, b, dw, ws, ws2); });
  CK(cudaDeviceSynchronize());
  unsigned long long h = fnv(y, n * 2, fnv(dw, H * 2, fnv(dx, n * 2, 1469598103934665603ull)));
  if (gated) h = fnv(dgate, n * 2, h);
  std::printf("%-12s %s %6lld x %-5lld fwd %7.2f us  bwd %7.2f us  %016llx\n", label, name,
              rows, H, fwd_us, bwd_us, h);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(dy), static_cast<void*>(y),
                  static_cast<void*>(dx), static_cast<void*>(w), static_cast<void*>(dw),
                  static_cast<void*>(rstd), static_cast<void*>(ws), static_cast<void*>(ws2),
                  static_cast<void*>(w32),
                  static_cast<void*>(gate), static_cast<void*>(dgate)})
    CK(cudaFree(p));
}

int main(int argc, char** argv) {
  const char* label = argc > 1 ? argv[1] : "default";
  Timer timer;
  for (size_t smem : {size_t{0}, size_t{1024}, size_t{8704}, size_t{40960}, size_t{102400}})
    floor_case(label, "floor", smem, -1, timer);
  floor_case(label, "floor carveout 0", 8704, 0, timer);
  floor_case(label, "floor carveout 100", 8704, 100, timer);
  norm_case(label, "norm", OP_RMS, 1, 2048, timer);
  norm_case(label, "norm", OP_RMS, 64, 2048, timer);
  norm_case(label, "norm", OP_RMS, 4096, 2048, timer);
  norm_case(label, "norm", OP_RMS, 32768, 2048, timer);
  norm_case(label, "norm", OP_RMS, 64, 256, timer);
  norm_case(label, "norm", OP_RMS, 4096, 256, timer);
  for (long long rows : extra_rows()) norm_case(label, "norm", OP_RMS, rows, 2048, timer);
  if (gated_cases_on()) {
    norm_case(label, "gated vllm", OP_GATED, 2097152, 128, timer);
    norm_case(label, "gated hf", OP_GATED, 2097152, 128, timer, F_HF);
    // the GDN norm's other head size, the same bytes
    norm_case(label, "gated vllm", OP_GATED, 1048576, 256, timer);
  }
  return 0;
}
