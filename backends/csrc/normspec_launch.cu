// Entry points of the normspec CUDA kernels (normspec_launch.h); the kernels are
// instantiated in the launch units, launch_units/<dtype>_<op>_<direction>.cu.
#include <atomic>

#include "normspec_launch_impl.cuh"

namespace normspec {
namespace launch_detail {
#define NS_EXTERN_FORWARD(OP, T) \
  extern template void forward_t<OP, T>(const LaunchArgs& a, cudaStream_t stream);
#define NS_EXTERN_BACKWARD(OP, T)                                                     \
  extern template void backward_t<OP, T>(const LaunchArgs& a, float* ws,              \
                                         const BackwardPlan& plan, cudaStream_t stream);
NORMSPEC_EACH_UNIT(NS_EXTERN_FORWARD, NS_EXTERN_BACKWARD)
#undef NS_EXTERN_FORWARD
#undef NS_EXTERN_BACKWARD
}  // namespace launch_detail

using namespace launch_detail;

namespace {

cudaError_t dispatch(int op, int dtype, bool backward, LaunchArgs a, float* ws,
                     const BackwardPlan* plan, cudaStream_t stream) {
  switch (dtype) {
    case DT_F32:
      set_alignment(a, 4);
      dispatch_op<float>(op, backward, a, ws, plan, stream);
      break;
    case DT_BF16:
      set_alignment(a, 2);
      dispatch_op<__nv_bfloat16>(op, backward, a, ws, plan, stream);
      break;
    case DT_F16:
      set_alignment(a, 2);
      dispatch_op<__half>(op, backward, a, ws, plan, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Launches `kernel` after the stream's previous kernel, letting it start (and wait in
// normspec::wait_for_previous_grid) while that kernel finishes, where
// chained_launches(stream) allows it; else a plain launch. The kernels launched so call
// wait_for_previous_grid() before touching memory.
template <typename... Params, typename... Args>
cudaError_t launch_chained(void (*kernel)(Params...), dim3 grid, dim3 block,
                           cudaStream_t stream, Args... args) {
  if (!chained_launches(stream)) {
    kernel<<<grid, block, 0, stream>>>(args...);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  const cudaError_t launched = cudaLaunchKernelEx(&config, kernel, args...);
  const cudaError_t last = cudaGetLastError();  // cleared, as on the plain path
  return launched != cudaSuccess ? launched : last;
}

}  // namespace

int current_device_sms() { return device_sms(); }

bool chained_launches(cudaStream_t stream) {
  // per device: 1 when it runs the tree kernels from code built for sm_90 or later
  // (where they wait for the previous grid), -1 when not; 0 until asked
  static std::atomic<int> waits[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return false;
  }
  if (waits[dev].load(std::memory_order_relaxed) == 0) {
    int major = 0;
    cudaFuncAttributes fa{};
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        cudaFuncGetAttributes(&fa, normspec_col_tree_last_kernel<float>) == cudaSuccess;
    if (!ok) cudaGetLastError();
    waits[dev].store(ok && major >= 9 && fa.ptxVersion >= 90 ? 1 : -1,
                     std::memory_order_relaxed);
  }
  if (waits[dev].load(std::memory_order_relaxed) < 0) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusNone;
}

BackwardPlan backward_plan_for(int dtype, LaunchArgs a, int sm_count) {
  set_alignment(a, dtype == DT_F32 ? 4 : 2);
  return backward_plan_aligned(dtype, a.rows, a.H, (a.flags & F_ALIGNED) != 0, sm_count,
                               device_smem_optin());
}

bool reads_weight_in_input_dtype(int op, int dtype, LaunchArgs a, const BackwardPlan* plan) {
  if (a.w_in_dtype == nullptr || dtype == DT_F32) return false;
  set_alignment(a, 2);
  if (plan != nullptr) return plan->pipe != 0 && (a.flags & F_ALIGNED);
  return forward_kind(query_of(op, dtype, false, a)) != FWD_REGISTER;
}

bool writes_dweight_final(int dtype, int weight_dtype, const BackwardPlan& plan) {
  return plan.pipe != 0 && plan.groups == 1 && dtype != DT_F32 && weight_dtype == dtype;
}

cudaError_t launch_forward(int op, int dtype, LaunchArgs a, cudaStream_t stream) {
  // nothing to compute; and the whole-block forms take block b as row b (grid_for gives
  // at least one block), so they must not be launched without rows
  if (a.rows <= 0 || a.H <= 0) return cudaSuccess;
  if (!reads_weight_in_input_dtype(op, dtype, a, nullptr)) {
    if (a.w == nullptr) return cudaErrorInvalidValue;
    a.w_in_dtype = nullptr;
  }
  return dispatch(op, dtype, false, a, nullptr, nullptr, stream);
}

cudaError_t launch_backward(int op, int dtype, LaunchArgs a, float* ws, const BackwardPlan& plan,
                            cudaStream_t stream) {
  if (a.rows <= 0 || a.H <= 0) return cudaSuccess;  // as launch_forward
  if (!reads_weight_in_input_dtype(op, dtype, a, &plan)) {
    if (a.w == nullptr) return cudaErrorInvalidValue;
    a.w_in_dtype = nullptr;
  }
  return dispatch(op, dtype, true, a, ws, &plan, stream);
}

long long col_tree_rows_out(long long G) {
  const long long C = next_pow2(G) < 16 ? next_pow2(G) : 16;
  return (G + C - 1) / C;
}

cudaError_t launch_col_tree(const float* in, float* out, long long G, long long H,
                            cudaStream_t stream) {
  const long long C = next_pow2(G) < 16 ? next_pow2(G) : 16;
  int clog = 0;
  while ((1LL << clog) < C) ++clog;
  const long long gout = (G + C - 1) / C;
  const dim3 grid(static_cast<unsigned>(grid_for(H, 256)), static_cast<unsigned>(gout < 65535 ? gout : 65535));
  return launch_chained(normspec_col_tree_kernel, grid, dim3(256), stream, in, out, G, H, clog);
}

ColTreeLast col_tree_last_logs(long long G) {
  const long long P = next_pow2(G);
  const long long C1 = P < 16 ? P : 16;
  ColTreeLast t{0, 0};
  while ((1LL << t.clog1) < C1) ++t.clog1;
  while ((C1 << t.slog) < P) ++t.slog;
  return t;
}

cudaError_t launch_col_tree_last(const float* in, void* out, int out_dtype, long long G,
                                 long long H, cudaStream_t stream) {
  if (G < 1 || G > kColTreeLastMax) return cudaErrorInvalidValue;
  const ColTreeLast t = col_tree_last_logs(G);
  const int clog1 = t.clog1, slog = t.slog;
  const dim3 grid(static_cast<unsigned>(grid_for(H, 16))), block(16, 16);
  switch (out_dtype) {
    case DT_F32:
      return launch_chained(normspec_col_tree_last_kernel<float>, grid, block, stream, in,
                            static_cast<float*>(out), G, H, clog1, slog);
    case DT_BF16:
      return launch_chained(normspec_col_tree_last_kernel<__nv_bfloat16>, grid, block, stream,
                            in, static_cast<__nv_bfloat16*>(out), G, H, clog1, slog);
    case DT_F16:
      return launch_chained(normspec_col_tree_last_kernel<__half>, grid, block, stream, in,
                            static_cast<__half*>(out), G, H, clog1, slog);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace normspec
