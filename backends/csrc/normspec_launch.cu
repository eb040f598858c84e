// Launchers of the normspec CUDA kernels (torch-free; see normspec_launch.h).
// Geometry: a team of `threads` threads (a power of two, 32..1024) handles a
// row; rows whose padded length fits in registers use the register kernels
// with NP passes, longer rows the streaming kernels.
//
// Tuning override (read once per process, at the first launch or plan):
//   NORMSPEC_FWD_TEAM=<threads>  (a power of two, 32..1024)
//   NORMSPEC_BWD_TEAM=<threads>  (a power of two, 32..256: the backward kernel's bound)
// replace the team size of the register kernels; NP is then the smallest of
// 1, 2, 4 with NP * threads * VEC >= H, and where none fits the default
// geometry (possibly the streaming kernel) is kept. Every geometry gives the
// same bits (the reductions follow the spec's tree by index). Invalid values
// are ignored with one warning on stderr.
#include <cuda_runtime.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "normspec_kernels.cuh"
#include "normspec_launch.h"

namespace normspec {
namespace {

struct Geometry {
  int threads;  // per team (a row)
  int np;       // passes held in registers; 0 = streaming kernel
};

int vec_of(int dtype) { return dtype == DT_F32 ? 4 : 8; }

Geometry default_geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 1024) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 2048) return {1024, 2};
  if (nvec <= 4096) return {1024, 4};
  return {1024, 0};
}

// The backward keeps more per element (dxhat, the dweight stacks): teams of
// at most 256 threads.
Geometry default_backward_geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 256) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 512) return {256, 2};
  if (nvec <= 1024) return {256, 4};
  return {1024, 0};
}

// The team size in environment variable `name` (0 = unset or invalid).
int team_from_env(const char* name, int max_threads) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno == 0 && end != s && *end == '\0' && v >= 32 && v <= max_threads &&
      (v & (v - 1)) == 0)
    return static_cast<int>(v);
  std::fprintf(stderr,
               "normspec: ignoring %s=%s (expected a power of two in 32..%d); "
               "using the default geometry\n",
               name, s, max_threads);
  return 0;
}

int forward_team_override() {
  static const int threads = team_from_env("NORMSPEC_FWD_TEAM", 1024);
  return threads;
}

int backward_team_override() {
  static const int threads = team_from_env("NORMSPEC_BWD_TEAM", 256);
  return threads;
}

// `threads` per team with the fewest passes (1, 2 or 4) that cover H; `fallback`
// when there is no override or no pass count fits.
Geometry with_team(int threads, long long H, int vec, Geometry fallback) {
  if (threads <= 0) return fallback;
  for (int np = 1; np <= 4; np *= 2)
    if (static_cast<long long>(np) * threads * vec >= H) return {threads, np};
  return fallback;
}

Geometry geometry(long long H, int vec) {
  return with_team(forward_team_override(), H, vec, default_geometry(H, vec));
}

// backward_plan and the launch both use this (the plan's glog bound and
// blocks per SM follow the team).
Geometry backward_geometry(long long H, int vec) {
  return with_team(backward_team_override(), H, vec, default_backward_geometry(H, vec));
}

int max_group_log(int np) {
  switch (np) {
    case 1:
      return MaxGroupLog<1>::value;
    case 2:
      return MaxGroupLog<2>::value;
    case 4:
      return MaxGroupLog<4>::value;
    default:
      return 0;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

bool rows_aligned(const void* p, long long stride, int esize) {
  return p == nullptr || (aligned16(p) && (stride * esize) % 16 == 0);
}

unsigned grid_for(long long units, int per_block) {
  long long blocks = (units + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > (1LL << 30)) blocks = 1LL << 30;
  return static_cast<unsigned>(blocks);
}

void set_alignment(LaunchArgs& a, int esize) {
  const bool ok = rows_aligned(a.x, a.sx, esize) && rows_aligned(a.r, a.sr, esize) &&
                  rows_aligned(a.dy, a.sdy, esize) && rows_aligned(a.dres, a.sdres, esize) &&
                  rows_aligned(a.y, a.sy, esize) && rows_aligned(a.y2, a.sy2, esize) &&
                  (a.w == nullptr || aligned16(a.w));
  if (ok) a.flags |= F_ALIGNED;
}

template <int OP, typename T>
void forward_t(const LaunchArgs& a, cudaStream_t stream) {
  const Geometry g = geometry(a.H, VecOf<T>::value);
  const int tpb = g.threads == 32 ? 4 : 1;
  const dim3 block(g.threads, tpb);
  const dim3 grid(grid_for(a.rows, tpb));
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.r);
  T* y = static_cast<T*>(a.y);
  T* y2 = static_cast<T*>(a.y2);
#define NS_FWD_ARGS \
  x, r, a.w, y, y2, a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags
  switch (g.np) {
    case 1:
      normspec_fwd_kernel<OP, T, 1><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
      break;
    case 2:
      normspec_fwd_kernel<OP, T, 2><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
      break;
    case 4:
      normspec_fwd_kernel<OP, T, 4><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
      break;
    default:
      normspec_fwd_stream_kernel<OP, T><<<grid_for(a.rows, 1), 1024, 0, stream>>>(NS_FWD_ARGS);
  }
#undef NS_FWD_ARGS
}

template <int OP, typename T>
void backward_t(const LaunchArgs& a, float* ws, const BackwardPlan& plan, cudaStream_t stream) {
  const Geometry g = backward_geometry(a.H, VecOf<T>::value);
  const int tpb = g.threads == 32 ? 4 : 1;
  const dim3 block(g.threads, tpb);
  const dim3 grid(grid_for(plan.groups, tpb));
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.r);
  const T* dy = static_cast<const T*>(a.dy);
  const T* dres = static_cast<const T*>(a.dres);
  T* dx = static_cast<T*>(a.y);
  T* d2 = static_cast<T*>(a.y2);
#define NS_BWD_ARGS                                                                        \
  x, r, a.w, dy, dres, dx, d2, ws, a.rows, a.H, a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2, \
      a.eps, a.offset, a.flags
  switch (g.np) {
    case 1:
      normspec_bwd_kernel<OP, T, 1><<<grid, block, 0, stream>>>(NS_BWD_ARGS, plan.glog);
      break;
    case 2:
      normspec_bwd_kernel<OP, T, 2><<<grid, block, 0, stream>>>(NS_BWD_ARGS, plan.glog);
      break;
    case 4:
      normspec_bwd_kernel<OP, T, 4><<<grid, block, 0, stream>>>(NS_BWD_ARGS, plan.glog);
      break;
    default:
      normspec_bwd_stream_kernel<OP, T><<<grid_for(a.rows, 1), 1024, 0, stream>>>(NS_BWD_ARGS);
  }
#undef NS_BWD_ARGS
}

template <typename T>
void dispatch_op(int op, bool backward, const LaunchArgs& a, float* ws, const BackwardPlan* plan,
                 cudaStream_t stream) {
  switch (op) {
    case OP_RMS:
      backward ? backward_t<OP_RMS, T>(a, ws, *plan, stream) : forward_t<OP_RMS, T>(a, stream);
      break;
    case OP_FUSED:
      backward ? backward_t<OP_FUSED, T>(a, ws, *plan, stream)
               : forward_t<OP_FUSED, T>(a, stream);
      break;
    default:
      backward ? backward_t<OP_GATED, T>(a, ws, *plan, stream)
               : forward_t<OP_GATED, T>(a, stream);
  }
}

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

}  // namespace

BackwardPlan backward_plan(int dtype, long long rows, long long H, int sm_count) {
  const Geometry g = backward_geometry(H, vec_of(dtype));
  BackwardPlan plan;
  if (g.np > 0) {
    const int per_sm = 2048 / g.threads > 1 ? 2048 / g.threads : 1;
    const long long target = static_cast<long long>(sm_count) * per_sm;
    const long long prow = next_pow2(rows);
    const int ml = max_group_log(g.np);
    while (plan.glog < ml && (1LL << (plan.glog + 1)) <= prow) {
      const long long R = 1LL << (plan.glog + 1);
      if ((rows + R - 1) / R < target) break;
      ++plan.glog;
    }
  }
  const long long R = 1LL << plan.glog;
  plan.groups = (rows + R - 1) / R;
  return plan;
}

cudaError_t launch_forward(int op, int dtype, LaunchArgs a, cudaStream_t stream) {
  return dispatch(op, dtype, false, a, nullptr, nullptr, stream);
}

cudaError_t launch_backward(int op, int dtype, LaunchArgs a, float* ws, const BackwardPlan& plan,
                            cudaStream_t stream) {
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
  const dim3 grid(grid_for(H, 256), static_cast<unsigned>(gout < 65535 ? gout : 65535));
  normspec_col_tree_kernel<<<grid, 256, 0, stream>>>(in, out, G, H, clog);
  return cudaGetLastError();
}

}  // namespace normspec
