// The launch machinery of the normspec CUDA kernels (torch-free), shared by
// normspec_launch.cu (the entry points of normspec_launch.h) and the launch units
// launch_units/<dtype>_<op>_<direction>.cu, each of which instantiates one forward_t or
// backward_t (NORMSPEC_FORWARD_UNIT, NORMSPEC_BACKWARD_UNIT), so that a build compiles
// them side by side, one core apiece.
//
// What a call launches is decided by the launch plan (normspec_plan.h) of its query; this
// file builds the query from the call and the device, asks the plan, and dispatches on its
// kernel family and template arguments.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "normspec_launch.h"
#include "normspec_pipe.cuh"
#include "normspec_gated_bwd.cuh"

namespace normspec {
namespace launch_detail {

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline bool rows_aligned(const void* p, long long stride, int esize) {
  return p == nullptr || (aligned16(p) && (stride * esize) % 16 == 0);
}

inline void set_alignment(LaunchArgs& a, int esize) {
  const bool ok = rows_aligned(a.x, a.sx, esize) && rows_aligned(a.r, a.sr, esize) &&
                  rows_aligned(a.dy, a.sdy, esize) && rows_aligned(a.dres, a.sdres, esize) &&
                  rows_aligned(a.y, a.sy, esize) && rows_aligned(a.y2, a.sy2, esize) &&
                  (a.w == nullptr || aligned16(a.w)) &&
                  (a.w_in_dtype == nullptr || aligned16(a.w_in_dtype));
  if (ok) a.flags |= F_ALIGNED;
}

// Whether every element offset of a launch's tensors and every row index, with the
// team's slots past the last one, stays below 2^31: at most 2^30 rows (the persistent
// grid's teams past them add at most SMs x 2048 x 8 rows; within 2^31 for fewer than
// 65536 SMs), and the last row's last element, (rows - 1) * (the largest stride, or H) +
// H - 1, at most 2^31 - 2. normspec_gated_bwd_pair_kernel does its row arithmetic in
// 32 bits and takes only such launches.
inline bool offsets_fit_32(const LaunchArgs& a) {
  long long m = a.H;
  for (long long s : {a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2}) m = s > m ? s : m;
  return a.rows <= (1LL << 30) && m <= 0x7fffffffLL &&
         (a.rows - 1) * m <= 0x7fffffffLL - a.H;
}

// Multiprocessors of the current device, cached per device (132, an H100/H200,
// when the runtime cannot tell: only the grid size depends on it, not the bits).
inline int device_sms() {
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return 132;
  }
  if (cache[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      return 132;
    }
    cache[dev] = n;
  }
  return cache[dev];
}

// Resident blocks per SM of `kernel` (cached by the caller; at least 1).
template <typename K>
int blocks_per_sm(K kernel, int block, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, smem) != cudaSuccess) {
    cudaGetLastError();
    n = 1;
  }
  return n > 0 ? n : 1;
}

// Shared memory a block may opt in to on the current device, cached per device
// (227 KiB, the H100/H200 value, when the runtime cannot tell).
inline int device_smem_optin() {
  constexpr int kFallback = 232448;
  static int cache[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return kFallback;
  }
  if (cache[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
            cudaSuccess ||
        n <= 0) {
      cudaGetLastError();
      return kFallback;
    }
    cache[dev] = n;
  }
  return cache[dev];
}

template <typename T>
struct DtypeOf {
  static constexpr int value = std::is_same<T, float>::value ? DT_F32
                               : IsBf16<T>::value            ? DT_BF16
                                                             : DT_F16;
};

// The plan's query for a call (alignment already set in a.flags).
inline PlanQuery query_of(int op, int dtype, bool backward, const LaunchArgs& a) {
  PlanQuery q;
  q.op = op;
  q.dtype = dtype;
  q.backward = backward;
  q.rows = a.rows;
  q.H = a.H;
  q.aligned = (a.flags & F_ALIGNED) != 0;
  q.w_raw = a.w_in_dtype != nullptr;
  q.hf = (a.flags & F_HF) != 0;
  q.w_is_input = (a.flags & F_W_IS_INPUT) != 0;
  q.saved_rstd = a.rstd_in != nullptr;
  q.offsets_fit_32 = offsets_fit_32(a);
  q.sms = device_sms();
  q.smem_optin = device_smem_optin();
  return q;
}

inline unsigned grid_of(long long blocks) { return static_cast<unsigned>(blocks); }

// Sets `w` to the weight a pipelined kernel reads, and F_W_RAW in a.flags where that is
// the weight in the input dtype. It returns nothing so that it cannot sit in a launch's
// argument list next to a.flags: arguments are evaluated in no fixed order, and a
// pointer-returning form called there can read a bf16 weight as fp32.
inline void take_pipe_weight(LaunchArgs& a, const void*& w) {
  if (a.w_in_dtype == nullptr) {
    w = a.w;
    return;
  }
  a.flags |= F_W_RAW;
  w = a.w_in_dtype;
}
// Let `kernel` use all the dynamic shared memory the device allows a block
// (past 48 KiB, static included, a kernel must opt in). Always the same value,
// so launches with different needs never undo each other's opt-in.
template <typename K>
void allow_smem(K kernel) {
  int dev = 0, optin = 0;
  cudaFuncAttributes fa;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess ||
      cudaFuncGetAttributes(&fa, kernel) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           optin - static_cast<int>(fa.sharedSizeBytes)) != cudaSuccess)
    cudaGetLastError();  // the launch then reports the error
}
// Dynamic shared memory that needs the opt-in (with the kernels' few static bytes).
inline bool needs_optin(long long bytes) { return bytes + STATIC_SMEM_ROOM > 48 * 1024; }
// allow_smem once per kernel (the caller's `done`) and device.
template <typename K>
void allow_smem_once(K kernel, bool (&done)[64]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    allow_smem(kernel);
    return;
  }
  if (!done[dev]) {
    allow_smem(kernel);
    done[dev] = true;
  }
}

// Calls f(std::integral_constant<int, TL>{}) for the TL in [LO, HI] equal to
// team_log, so that a runtime team size picks a kernel instantiated for it;
// returns whether one did.
template <int LO, int HI, typename F>
bool with_team_log(int team_log, F&& f) {
  if constexpr (LO > HI) {
    return false;
  } else {
    if (team_log == LO) {
      f(std::integral_constant<int, LO>{});
      return true;
    }
    return with_team_log<LO + 1, HI>(team_log, f);
  }
}

// ---- the gated forward's gate table in global memory ---------------------------------
// Large bf16 gated forwards run the one-row kernel with act(z) read from a gate table in
// global memory (normspec_fwd_row_kernel's GT). The table (both activations) is a device
// variable of this translation unit, filled once per process and device by a synchronous
// launch on the caller's stream; while a stream is being captured into a CUDA graph it is
// not filled, and such a launch takes the plan without it (the persistent kernel).
template <typename T>
__device__ float gate_table_storage[2 * GATE_TABLE_SLOTS];
// The filled table of one activation on the current device, or nullptr (capturing
// before the first fill, or a CUDA error, which is cleared).
template <typename T>
const float* global_gate_table(bool sig, cudaStream_t stream) {
  static std::atomic<bool> filled[64][2] = {};
  static std::atomic<float*> bases[64] = {};  // the variable's address on each device
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return nullptr;
  }
  float* base = bases[dev].load(std::memory_order_acquire);
  if (base == nullptr) {
    void* found = nullptr;
    if (cudaGetSymbolAddress(&found, gate_table_storage<T>) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    base = static_cast<float*>(found);
    bases[dev].store(base, std::memory_order_release);
  }
  float* tab = base + (sig ? GATE_TABLE_SLOTS : 0);
  if (!filled[dev][sig].load(std::memory_order_acquire)) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return nullptr;
    }
    normspec_fill_gate_table_kernel<T><<<GATE_TABLE_SLOTS / 256, 256, 0, stream>>>(tab, sig);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return nullptr;
    filled[dev][sig].store(true, std::memory_order_release);
  }
  return tab;
}

// ---- forward launches ----------------------------------------------------------------
template <int OP, typename T, int NP, int FULL_TL, bool GT = false, int GTF = 0>
void launch_row(LaunchArgs a, const LaunchPlan& p, cudaStream_t stream,
                const float* gtab = nullptr) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  normspec_fwd_row_kernel<OP, T, NP, FULL_TL, GT, GTF>
      <<<grid_of(p.grid), p.block_x, 0, stream>>>(
          static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<T*>(a.y),
          static_cast<T*>(a.y2), a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset,
          a.flags, p.team_log, a.rstd_out, gtab);
}

// K_FWD_ROW: the global table's forms (bf16 gated, two passes, teams of 4..64 lanes), the
// constant forms (default passes: teams of 2..256; one pass: 16..256) or the general one.
template <int OP, typename T>
void forward_row_t(const LaunchArgs& a, const LaunchPlan& p, const float* gtab,
                   cudaStream_t stream) {
  if (p.gt_form != 0) {
    if constexpr (OP == OP_GATED && IsBf16<T>::value) {
      with_team_log<2, 6>(p.full_tl, [&](auto tl) {
        constexpr int TL = decltype(tl)::value;
        switch (p.gt_form) {
          case 1:
            return launch_row<OP, T, 2, TL, true, 1>(a, p, stream, gtab);
          case 2:
            return launch_row<OP, T, 2, TL, true, 2>(a, p, stream, gtab);
          case 3:
            return launch_row<OP, T, 2, TL, true, 3>(a, p, stream, gtab);
          case 4:
            return launch_row<OP, T, 2, TL, true, 4>(a, p, stream, gtab);
          default:
            return launch_row<OP, T, 2, TL, true, 5>(a, p, stream, gtab);
        }
      });
    }
    return;
  }
  constexpr int DEFAULT_NP = OP == OP_RMS ? 4 : 2;
  if (p.full_tl >= 0 && p.np == DEFAULT_NP) {
    with_team_log<1, 8>(p.full_tl, [&](auto tl) {
      launch_row<OP, T, DEFAULT_NP, decltype(tl)::value>(a, p, stream);
    });
    return;
  }
  if (p.full_tl >= 0) {  // one pass
    with_team_log<4, 8>(p.full_tl, [&](auto tl) {
      launch_row<OP, T, 1, decltype(tl)::value>(a, p, stream);
    });
    return;
  }
  switch (p.np) {
    case 1:
      return launch_row<OP, T, 1, -1>(a, p, stream);
    case 2:
      return launch_row<OP, T, 2, -1>(a, p, stream);
    default:
      return launch_row<OP, T, 4, -1>(a, p, stream);
  }
}

// K_FWD_QUAD: the q/k forward in vectors of four (16-bit rms and fused rows), the weight
// read as it is.
template <int OP, typename T>
void launch_quad(LaunchArgs a, const LaunchPlan& p, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2 && OP != OP_GATED) {
    const void* w = nullptr;
    take_pipe_weight(a, w);  // the weight as it is, F_W_RAW set as for the row kernels
    auto go = [&](auto kernel) {
      kernel<<<grid_of(p.grid), p.block_x, 0, stream>>>(
          static_cast<const T*>(a.x), static_cast<const T*>(a.r), static_cast<const T*>(w),
          static_cast<T*>(a.y), static_cast<T*>(a.y2),
          static_cast<int>(a.rows), a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags,
          a.rstd_out);
    };
    if (p.np == 6) {
      go(normspec_fwd_quad_kernel<OP, T, 6>);
    } else {
      go(normspec_fwd_quad_kernel<OP, T, 5>);
    }
  } else {
    static_cast<void>(a), static_cast<void>(p), static_cast<void>(stream);
  }
}

template <int OP, typename T, int NP, int FULL_TL>
void launch_fwd_pipe(LaunchArgs a, const LaunchPlan& p, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  static int occ[9][2] = {{0}};
  static bool opted[64] = {false};
  if (p.table) a.flags |= F_GATE_TABLE;
  const size_t smem = static_cast<size_t>(p.smem);
  auto kernel = normspec_fwd_pipe_kernel<OP, T, NP, FULL_TL>;
  if (needs_optin(p.smem)) allow_smem_once(kernel, opted);
  int& n = occ[p.team_log][p.table];
  if (n == 0) n = blocks_per_sm(kernel, p.block_x, smem);
  const unsigned grid = grid_of(persistent_grid(p, n, device_sms()));
  kernel<<<grid, p.block_x, smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<T*>(a.y),
      static_cast<T*>(a.y2), a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags,
      p.team_log, a.rstd_out);
}

// K_FWD_PIPE: the persistent forward; its constant forms are the gate table's (bf16
// gated, one or two passes over teams of 4..32 lanes).
template <int OP, typename T>
void forward_pipe_t(const LaunchArgs& a, const LaunchPlan& p, cudaStream_t stream) {
  if (p.full_tl >= 0) {
    if constexpr (OP == OP_GATED && IsBf16<T>::value) {
      auto go = [&](auto np) {
        constexpr int NP = decltype(np)::value;
        with_team_log<2, 5>(p.full_tl, [&](auto tl) {
          launch_fwd_pipe<OP, T, NP, decltype(tl)::value>(a, p, stream);
        });
      };
      if (p.np == 1) return go(std::integral_constant<int, 1>());
      return go(std::integral_constant<int, 2>());
    }
    return;
  }
  switch (p.np) {
    case 1:
      return launch_fwd_pipe<OP, T, 1, -1>(a, p, stream);
    case 2:
      return launch_fwd_pipe<OP, T, 2, -1>(a, p, stream);
    default:
      return launch_fwd_pipe<OP, T, 4, -1>(a, p, stream);
  }
}

template <int OP, typename T>
void forward_t(const LaunchArgs& a, cudaStream_t stream) {
  PlanQuery q = query_of(OP, DtypeOf<T>::value, false, a);
  LaunchPlan p = launch_plan(q);
  const float* gtab = nullptr;
  if constexpr (OP == OP_GATED && IsBf16<T>::value) {
    if (p.gt_form != 0) {
      gtab = global_gate_table<T>((a.flags & F_SIGMOID) != 0, stream);
      if (gtab == nullptr) {
        q.global_table = false;
        p = launch_plan(q);
      }
    }
  }
  switch (p.kernel) {
    case K_FWD_ROW:
      return forward_row_t<OP, T>(a, p, gtab, stream);
    case K_FWD_QUAD:
      return launch_quad<OP, T>(a, p, stream);
    case K_FWD_PIPE:
      return forward_pipe_t<OP, T>(a, p, stream);
    default:
      break;
  }
  const dim3 block(p.block_x, p.block_y);
  const dim3 grid(grid_of(p.grid));
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.r);
  T* y = static_cast<T*>(a.y);
  T* y2 = static_cast<T*>(a.y2);
#define NS_FWD_ARGS \
  x, r, a.w, y, y2, a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags, a.rstd_out
  if (p.kernel == K_FWD_STREAM) {
    normspec_fwd_stream_kernel<OP, T><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
    return;
  }
  switch (p.np) {
    case 1:
      normspec_fwd_kernel<OP, T, 1><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
      break;
    case 2:
      normspec_fwd_kernel<OP, T, 2><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
      break;
    default:
      normspec_fwd_kernel<OP, T, 4><<<grid, block, 0, stream>>>(NS_FWD_ARGS);
  }
#undef NS_FWD_ARGS
}

// ---- backward launches ---------------------------------------------------------------
// The kernel that reads the given rstd where there is one (SAVED), else the one that
// computes it: two instantiations, so that neither carries the other's registers.
template <int OP, typename T, int NP, int FULL_TL, bool SAVED, int GC = -1>
void launch_bwd_pipe_as(LaunchArgs a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  static int occ[9][MAX_PIPE_GLOG + 1][2] = {{{0}}};
  static bool opted[64] = {false};
  if (p.table) a.flags |= F_GATE_TABLE;
  const size_t smem = static_cast<size_t>(p.smem);
  auto kernel = normspec_bwd_pipe_kernel<OP, T, NP, FULL_TL, SAVED, GC>;
  if (needs_optin(p.smem)) allow_smem_once(kernel, opted);
  int& n = occ[p.team_log][p.glog][p.table];
  if (n == 0) n = blocks_per_sm(kernel, p.block_x, smem);
  const unsigned grid = grid_of(persistent_grid(p, n, device_sms()));
  kernel<<<grid, p.block_x, smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<const T*>(a.dy),
      static_cast<const T*>(a.dres), static_cast<T*>(a.y), static_cast<T*>(a.y2), ws, a.rows,
      a.H, a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2, a.eps, a.offset, a.flags, p.team_log,
      p.glog, SAVED ? a.rstd_in : nullptr);
}

// K_BWD_PAIR: normspec_gated_bwd_pair_kernel, two rows a team per iteration, its row
// arithmetic in 32 bits (the plan checked offsets_fit_32).
template <typename T, int FULL_TL, int GC>
void launch_gated_bwd_pair(LaunchArgs a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  static int occ[MAX_PIPE_GLOG + 1] = {0};
  static bool opted[64] = {false};
  const size_t smem = static_cast<size_t>(p.smem);
  auto kernel = normspec_gated_bwd_pair_kernel<T, FULL_TL, GC>;
  if (needs_optin(p.smem)) allow_smem_once(kernel, opted);
  int& n = occ[p.glog];
  if (n == 0) n = blocks_per_sm(kernel, p.block_x, smem);
  const unsigned grid = grid_of(persistent_grid(p, n, device_sms()));
  kernel<<<grid, p.block_x, smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<const T*>(a.dy),
      static_cast<T*>(a.y), static_cast<T*>(a.y2), ws, static_cast<int>(a.rows),
      static_cast<int>(a.sx), static_cast<int>(a.sr), static_cast<int>(a.sdy),
      static_cast<int>(a.sy), static_cast<int>(a.sy2), a.offset, a.flags, p.glog,
      static_cast<int>(p.groups), a.rstd_in);
}

// K_BWD_ROW: the rms backward of one-row groups, a team per row.
template <typename T, int NP, int FULL_TL, bool SAVED>
void launch_bwd_row(LaunchArgs a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);  // sets F_W_RAW in a.flags
  normspec_bwd_row_kernel<T, NP, FULL_TL, SAVED><<<grid_of(p.grid), p.block_x, 0, stream>>>(
      static_cast<const T*>(a.x), w, static_cast<const T*>(a.dy), static_cast<T*>(a.y), ws,
      a.rows, a.sx, a.sdy, a.sy, a.eps, a.offset, a.flags, SAVED ? a.rstd_in : nullptr);
}

template <typename T, int NP, int FULL_TL>
void bwd_row_saved(const LaunchArgs& a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  if (p.saved) return launch_bwd_row<T, NP, FULL_TL, true>(a, ws, p, stream);
  launch_bwd_row<T, NP, FULL_TL, false>(a, ws, p, stream);
}

// The one-row forms: (NP, team_log) (1, 4), (1, 5), (2, 7), (2, 8) and the wide (1, 8).
template <int OP, typename T>
void backward_row_t(const LaunchArgs& a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  if constexpr (OP == OP_RMS) {
    if (p.np == 1) {
      with_team_log<4, 5>(p.full_tl, [&](auto tl) {
        bwd_row_saved<T, 1, decltype(tl)::value>(a, ws, p, stream);
      });
      if (p.full_tl == 8) bwd_row_saved<T, 1, 8>(a, ws, p, stream);
      return;
    }
    with_team_log<7, 8>(p.full_tl, [&](auto tl) {
      bwd_row_saved<T, 2, decltype(tl)::value>(a, ws, p, stream);
    });
  } else {
    static_cast<void>(a), static_cast<void>(ws), static_cast<void>(p), static_cast<void>(stream);
  }
}

template <int OP, typename T, int NP, int FULL_TL>
void bwd_pipe_saved(const LaunchArgs& a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  if (p.saved) return launch_bwd_pipe_as<OP, T, NP, FULL_TL, true>(a, ws, p, stream);
  launch_bwd_pipe_as<OP, T, NP, FULL_TL, false>(a, ws, p, stream);
}

// K_BWD_PIPE and K_BWD_PAIR: the constant forms (one pass at 16 and 32 lanes, two passes
// at 128 and 256 threads), the gate table's convention constants (GC) and the general form.
template <int OP, typename T>
void backward_pipe_t(const LaunchArgs& a, float* ws, const LaunchPlan& p, cudaStream_t stream) {
  if (p.gc >= 0) {
    if constexpr (OP == OP_GATED && IsBf16<T>::value) {
      with_team_log<4, 5>(p.full_tl, [&](auto tl) {
        constexpr int TL = decltype(tl)::value;
        auto launch_gc = [&](auto gc) {
          constexpr int GC = decltype(gc)::value;
          if (p.kernel == K_BWD_PAIR) return launch_gated_bwd_pair<T, TL, GC>(a, ws, p, stream);
          launch_bwd_pipe_as<OP, T, 1, TL, true, GC>(a, ws, p, stream);
        };
        if (p.gc == 0) return launch_gc(std::integral_constant<int, 0>());
        if (p.gc == 1) return launch_gc(std::integral_constant<int, 1>());
        launch_gc(std::integral_constant<int, 7>());
      });
    }
    return;
  }
  if (p.full_tl >= 0) {
    if (p.np == 1) {
      with_team_log<4, 5>(p.full_tl, [&](auto tl) {
        bwd_pipe_saved<OP, T, 1, decltype(tl)::value>(a, ws, p, stream);
      });
    } else {
      with_team_log<7, 8>(p.full_tl, [&](auto tl) {
        bwd_pipe_saved<OP, T, 2, decltype(tl)::value>(a, ws, p, stream);
      });
    }
    return;
  }
  switch (p.np) {
    case 1:
      return bwd_pipe_saved<OP, T, 1, -1>(a, ws, p, stream);
    case 2:
      return bwd_pipe_saved<OP, T, 2, -1>(a, ws, p, stream);
    default:
      return bwd_pipe_saved<OP, T, 4, -1>(a, ws, p, stream);
  }
}

template <int OP, typename T>
void backward_t(const LaunchArgs& a, float* ws, const BackwardPlan& plan, cudaStream_t stream) {
  PlanQuery q = query_of(OP, DtypeOf<T>::value, true, a);
  q.groups = plan;
  const LaunchPlan p = launch_plan(q);
  switch (p.kernel) {
    case K_BWD_ROW:
      return backward_row_t<OP, T>(a, ws, p, stream);
    case K_BWD_PIPE:
    case K_BWD_PAIR:
      return backward_pipe_t<OP, T>(a, ws, p, stream);
    default:
      break;
  }
  const dim3 block(p.block_x, p.block_y);
  const dim3 grid(grid_of(p.grid));
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.r);
  const T* dy = static_cast<const T*>(a.dy);
  const T* dres = static_cast<const T*>(a.dres);
  T* dx = static_cast<T*>(a.y);
  T* d2 = static_cast<T*>(a.y2);
#define NS_BWD_ARGS                                                                        \
  x, r, a.w, dy, dres, dx, d2, ws, a.rows, a.H, a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2, \
      a.eps, a.offset, a.flags
  if (p.kernel == K_BWD_STREAM) {
    normspec_bwd_stream_kernel<OP, T><<<grid, block, 0, stream>>>(NS_BWD_ARGS);
    return;
  }
  switch (p.np) {
    case 1:
      normspec_bwd_kernel<OP, T, 1><<<grid, block, 0, stream>>>(NS_BWD_ARGS, p.glog);
      break;
    case 2:
      normspec_bwd_kernel<OP, T, 2><<<grid, block, 0, stream>>>(NS_BWD_ARGS, p.glog);
      break;
    default:
      normspec_bwd_kernel<OP, T, 4><<<grid, block, 0, stream>>>(NS_BWD_ARGS, p.glog);
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
    case OP_FUSED_SUM:  // a backward only
      if (backward) backward_t<OP_FUSED_SUM, T>(a, ws, *plan, stream);
      break;
    default:
      backward ? backward_t<OP_GATED, T>(a, ws, *plan, stream)
               : forward_t<OP_GATED, T>(a, stream);
  }
}

}  // namespace launch_detail
}  // namespace normspec

// The explicit instantiations of the launch units (launch_units/*.cu) and the matching
// declarations in normspec_launch.cu, which dispatches to them (NORMSPEC_EACH_UNIT).
#define NORMSPEC_FORWARD_UNIT(OP, T)                                                 \
  namespace normspec {                                                               \
  namespace launch_detail {                                                          \
  template void forward_t<OP, T>(const LaunchArgs& a, cudaStream_t stream);         \
  }                                                                                  \
  }
#define NORMSPEC_BACKWARD_UNIT(OP, T)                                                \
  namespace normspec {                                                               \
  namespace launch_detail {                                                          \
  template void backward_t<OP, T>(const LaunchArgs& a, float* ws,                    \
                                  const BackwardPlan& plan, cudaStream_t stream);    \
  }                                                                                  \
  }
// Every unit of one dtype, as FORWARD(OP, T) and BACKWARD(OP, T): the forwards of the
// three ops, the backwards of the four (OP_FUSED_SUM has no forward of its own).
#define NORMSPEC_EACH_UNIT_OF(T, FORWARD, BACKWARD)                                     \
  FORWARD(OP_RMS, T) FORWARD(OP_FUSED, T) FORWARD(OP_GATED, T) BACKWARD(OP_RMS, T)     \
  BACKWARD(OP_FUSED, T) BACKWARD(OP_FUSED_SUM, T) BACKWARD(OP_GATED, T)
#define NORMSPEC_EACH_UNIT(FORWARD, BACKWARD)                  \
  NORMSPEC_EACH_UNIT_OF(float, FORWARD, BACKWARD)              \
  NORMSPEC_EACH_UNIT_OF(__nv_bfloat16, FORWARD, BACKWARD)      \
  NORMSPEC_EACH_UNIT_OF(__half, FORWARD, BACKWARD)
