// Host-side launch interface of the normspec CUDA kernels. Torch-free: the
// torch extension (normspec_cuda.cpp) calls these functions, which are
// implemented next to the kernels in normspec_launch.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "normspec_plan.h"

namespace normspec {

// Row pointers and strides (in elements) of one call; nullptr where unused.
//   forward:  x, r (residual / gate), w (fp32, H), y, y2 (new residual)
//   backward: x, r, w, dy, dres (gradient of the new residual), y = dx,
//             y2 = dresidual / dgate
struct LaunchArgs {
  const void* x = nullptr;
  const void* r = nullptr;
  const void* dy = nullptr;
  const void* dres = nullptr;
  void* y = nullptr;
  void* y2 = nullptr;
  const float* w = nullptr;
  // The weight in the input dtype (16-bit inputs, contiguous): the pipelined
  // kernels read it instead of w where reads_weight_in_input_dtype() says so,
  // so no fp32 copy (and no extra kernel launch) is needed; w may then be null.
  const void* w_in_dtype = nullptr;
  // rstd of every row (fp32, contiguous, `rows` values; the spec's bits): written
  // by the forward where rstd_out is set, read by the pipelined backward from
  // rstd_in where set (the other backward kernels recompute it: the same bits).
  float* rstd_out = nullptr;
  const float* rstd_in = nullptr;
  long long rows = 0, H = 0, sx = 0, sr = 0, sdy = 0, sdres = 0, sy = 0, sy2 = 0;
  float eps = 0.f, offset = 0.f;
  int flags = 0;  // normspec::Flags; F_ALIGNED is set by the launcher
};

// Multiprocessors of the current device (cached per device; 132 if the query fails).
int current_device_sms();

// The dweight groups of this call (BackwardPlan, normspec_plan.h): the pipelined
// kernels' when every row is 16-byte aligned and short enough, else backward_plan().
BackwardPlan backward_plan_for(int dtype, LaunchArgs a, int sm_count);

// Whether launch_forward (plan == nullptr) or launch_backward with `plan`
// reads the weight from a.w_in_dtype (set, 16-byte aligned, 16-bit dtype, and
// the call runs on a pipelined kernel); otherwise a.w must hold fp32 weights.
bool reads_weight_in_input_dtype(int op, int dtype, LaunchArgs a, const BackwardPlan* plan);
// Whether the backward kernel of `plan` stores dweight itself (a.flags | F_DW_FINAL,
// ws then pointing at H values of the input dtype): one dweight group, a 16-bit input
// and a weight of the same dtype, so the group's tree rounded to that dtype is
// dweight and no tree or cast launch follows.
bool writes_dweight_final(int dtype, int weight_dtype, const BackwardPlan& plan);
// Whether dweight's tree launches on `stream` are chained (programmatic dependent
// launch: each may start while the kernel before it finishes, and waits on the GPU):
// a device of compute capability 9.0 or later running kernels built for it, and a stream
// not being captured into a CUDA graph. Where they are, the backward kernel before them
// is launched with F_LET_DEPENDENTS.
bool chained_launches(cudaStream_t stream);
// Kernel launches on `stream`; they return cudaGetLastError() (cudaErrorInvalidValue
// when a.w is needed and null). Without rows or columns they launch nothing and return
// cudaSuccess: the caller fills empty outputs (dweight of no rows is zero).
cudaError_t launch_forward(int op, int dtype, LaunchArgs a, cudaStream_t stream);
cudaError_t launch_backward(int op, int dtype, LaunchArgs a, float* ws, const BackwardPlan& plan,
                            cudaStream_t stream);
// One level of the workspace row tree: out[o] = tree of in[o*C .. o*C + C)
// with C = min(16, next_pow2(G)); out has col_tree_rows_out(G) rows of H.
long long col_tree_rows_out(long long G);
cudaError_t launch_col_tree(const float* in, float* out, long long G, long long H,
                            cudaStream_t stream);
// The last levels of the tree and the cast in one launch, for G <= kColTreeLastMax:
// out (H elements of dtype out_dtype, a Dtype) = the weight-dtype tree of in's G rows.
constexpr long long kColTreeLastMax = 256;
// Its folds: 2**clog1 = min(16, next_pow2(G)) rows per segment, 2**slog segments.
struct ColTreeLast {
  int clog1, slog;
};
ColTreeLast col_tree_last_logs(long long G);
cudaError_t launch_col_tree_last(const float* in, void* out, int out_dtype, long long G,
                                 long long H, cudaStream_t stream);

}  // namespace normspec
