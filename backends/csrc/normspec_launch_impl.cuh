// The launch machinery of the normspec CUDA kernels (torch-free), shared by
// normspec_launch.cu (the entry points of normspec_launch.h) and the launch units
// launch_units/<dtype>_<op>_<direction>.cu, each of which instantiates one forward_t or
// backward_t (NORMSPEC_FORWARD_UNIT, NORMSPEC_BACKWARD_UNIT), so that a build compiles
// them side by side, one core apiece.
//
// Geometry: a team of `threads` threads (a power of two) handles a row; rows whose
// padded length fits in registers use the register kernels with NP passes, longer rows
// the streaming kernels, and 16-byte aligned rows of at most 1024 vectors the pipelined
// kernels (normspec_pipe.cuh). Every geometry gives the same bits: the reductions
// follow the spec's tree by index.
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

struct Geometry {
  int threads;  // per team (a row)
  int np;       // passes held in registers; 0 = streaming kernel
};

inline int vec_of(int dtype) { return dtype == DT_F32 ? 4 : 8; }

// The register kernels' geometry.
inline Geometry geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 1024) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 2048) return {1024, 2};
  if (nvec <= 4096) return {1024, 4};
  return {1024, 0};
}

// The backward keeps more per element (dxhat, the dweight stacks): teams of
// at most 256 threads. backward_plan and the launch both use this (the plan's glog
// bound and blocks per SM follow the team).
inline Geometry backward_geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 256) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 512) return {256, 2};
  if (nvec <= 1024) return {256, 4};
  return {1024, 0};
}

// The deepest dweight stacks of the pipelined backward's plan (pipe_max_glog).
constexpr int MAX_PIPE_GLOG = 5;

inline int max_group_log(int np) {
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

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

inline bool rows_aligned(const void* p, long long stride, int esize) {
  return p == nullptr || (aligned16(p) && (stride * esize) % 16 == 0);
}

inline unsigned grid_for(long long units, int per_block) {
  long long blocks = (units + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > (1LL << 30)) blocks = 1LL << 30;
  return static_cast<unsigned>(blocks);
}

inline void set_alignment(LaunchArgs& a, int esize) {
  const bool ok = rows_aligned(a.x, a.sx, esize) && rows_aligned(a.r, a.sr, esize) &&
                  rows_aligned(a.dy, a.sdy, esize) && rows_aligned(a.dres, a.sdres, esize) &&
                  rows_aligned(a.y, a.sy, esize) && rows_aligned(a.y2, a.sy2, esize) &&
                  (a.w == nullptr || aligned16(a.w)) &&
                  (a.w_in_dtype == nullptr || aligned16(a.w_in_dtype));
  if (ok) a.flags |= F_ALIGNED;
}

// ---- the pipelined kernels (normspec_pipe.cuh) ------------------------------------
// Used for 16-byte aligned rows of at most 1024 vectors (teams of <= 256 threads,
// NP <= 4).
struct PipeGeometry {
  int team_log = 0;
  int np = 0;  // 0: not eligible
  int block() const { return team_log <= 5 ? 256 : 1 << team_log; }
  long long teams_per_block() const { return block() >> team_log; }
};

inline int log2_exact(long long v) {
  int l = 0;
  while ((1LL << l) < v) ++l;
  return l;
}

// Teams of `threads` threads (at most 256) with the fewest passes (1, 2 or 4)
// that cover H; not eligible (np = 0) where none does.
inline PipeGeometry with_passes(long long threads, long long H, int vec) {
  PipeGeometry g;
  if (threads > 256) return g;
  for (int np = 1; np <= 4; np *= 2) {
    if (static_cast<long long>(np) * threads * vec >= H) {
      g.team_log = log2_exact(threads);
      g.np = np;
      return g;
    }
  }
  return g;
}

// NP the fewest passes that cover H: one pass up to 16 vectors in the forward and up to
// 32 in the backward (the faster split on the H200 at H = 128 and 256), two passes per
// thread above that; teams of 1..32 lanes share warps; 256 x 4 for 513..1024 vectors.
inline PipeGeometry pipe_geometry(long long H, int vec, bool backward) {
  const long long nvec = (H + vec - 1) / vec;
  const long long one_pass = backward ? 32 : 16;  // up to this many vectors: one pass
  long long threads;
  if (nvec <= one_pass) {
    threads = next_pow2(nvec);
  } else if (nvec <= 512) {
    threads = next_pow2(nvec) / 2;
  } else {
    threads = 256;
  }
  return with_passes(threads, H, vec);
}

// The one-row forward's constant forms index their row in 32 bits where teams are at most
// a warp (SLOT32 in normspec_fwd_row_kernel) and by blockIdx.x above that: more rows than
// 2^31 - 1 (which no output fits on today's devices) take the general form.
inline bool row_index_fits_32(long long rows) { return rows <= 0x7fffffffLL; }

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

inline int device_sms();

// The one-row-per-team forward: four vectors per thread for the rms norm and two for
// the ops that read two row tensors (the fastest splits at H = 2048 bf16).
// Few rows: a launch that cannot fill the GPU is bound by the latency of one
// row, which shortens with the vectors each thread walks; the team doubles (to
// one vector per thread at most) while the teams' threads stay within half the
// device's resident threads (SMs x 1024), so a full launch keeps the geometry above.
inline PipeGeometry row_geometry(long long H, int vec, bool two_inputs, long long rows) {
  const long long nvec = (H + vec - 1) / vec;
  const long long per_thread = two_inputs ? 2 : 4;
  long long threads = next_pow2(nvec) / per_thread;
  if (threads > 256) threads = 256;  // then more passes
  if (threads < 1) threads = 1;
  const long long one_vector = next_pow2(nvec) < 256 ? next_pow2(nvec) : 256;
  const long long resident_half = static_cast<long long>(device_sms()) * 1024;
  while (threads < one_vector && rows * threads * 2 <= resident_half) threads *= 2;
  return with_passes(threads, H, vec);
}

// Threads per block of the one-row forward: one team for teams of 64 and more
// lanes; for smaller teams (sharing warps) 256 threads, or one warp where the
// launch runs many waves (its teams' threads at least 8 times the device's
// resident threads, SMs x 2048), which measured faster there.
inline int row_block(const PipeGeometry& g, long long rows) {
  // a team of 64+ lanes is its block, one block per row: the one-row kernels' whole-block
  // forms take their row from blockIdx.x (PER_BLOCK in normspec_pipe.cuh), so this must stay
  if (g.team_log > 5) return 1 << g.team_log;
  const long long waves8 = static_cast<long long>(device_sms()) * 2048 * 8;
  if ((rows << g.team_log) >= waves8) return 32;
  return 256;
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

inline unsigned persistent_grid(long long teams, const PipeGeometry& g, int per_sm) {
  const long long need = (teams + g.teams_per_block() - 1) / g.teams_per_block();
  const long long cap = static_cast<long long>(per_sm) * device_sms();
  return grid_for(need < cap ? need : cap, 1);
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

// Room kept for the kernels' static shared memory (red: at most 1 KiB).
constexpr size_t STATIC_SMEM_ROOM = 2048;
inline bool fits_smem(size_t dynamic_bytes, int optin) {
  return dynamic_bytes + STATIC_SMEM_ROOM <= static_cast<size_t>(optin);
}

// Dynamic shared memory of the backward's dweight stacks.
inline size_t pipe_stack_bytes(const PipeGeometry& g, int vec, int glog) {
  return static_cast<size_t>(glog) * g.np * vec * sizeof(float) * g.block();
}

// Shared memory of the weight factors (fill_weight_smem: NP * VEC floats per lane).
inline size_t pipe_weight_bytes(const PipeGeometry& g, int vec) {
  return (static_cast<size_t>(g.np) * vec * sizeof(float)) << g.team_log;
}

// At most 40 KiB of stacks per block (five 256-thread blocks per SM), and the
// stacks and weight factors within what a block may opt in to (`optin` bytes:
// 99 KiB on sm_86/89/120, 64 KiB on sm_75). The gate table is optional and is
// left out at launch where it does not fit.
inline int pipe_max_glog(const PipeGeometry& g, int vec, int optin) {
  const size_t weights = pipe_weight_bytes(g, vec);
  int l = 0;
  while (l < MAX_PIPE_GLOG && pipe_stack_bytes(g, vec, l + 1) <= 40960 &&
         fits_smem(pipe_stack_bytes(g, vec, l + 1) + weights, optin))
    ++l;
  return l;
}

// The gate table (bf16 gates of launches with at least this many elements:
// below it, filling the table costs more than it saves).
constexpr long long GATE_TABLE_MIN_ELEMENTS = 1LL << 20;
inline bool wants_gate_table(int op, bool bf16, const LaunchArgs& a) {
  return op == OP_GATED && bf16 && a.rows * a.H >= GATE_TABLE_MIN_ELEMENTS;
}
template <int OP, typename T>
bool use_gate_table(const LaunchArgs& a) {
  return wants_gate_table(OP, IsBf16<T>::value, a);
}

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
inline bool needs_optin(size_t bytes) { return bytes + STATIC_SMEM_ROOM > 48 * 1024; }
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
template <int OP, typename T, int NP, int FULL_TL>
void launch_fwd_pipe(LaunchArgs a, const PipeGeometry& g, bool table, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  static int occ[9][2] = {{0}};
  static bool opted[64] = {false};
  constexpr int VEC = VecOf<T>::value;
  if (table) a.flags |= F_GATE_TABLE;
  const size_t smem = pipe_weight_bytes(g, VEC) + (table ? GATE_TABLE_SLOTS * sizeof(float) : 0);
  auto kernel = normspec_fwd_pipe_kernel<OP, T, NP, FULL_TL>;
  if (needs_optin(smem)) allow_smem_once(kernel, opted);
  int& n = occ[g.team_log][table];
  if (n == 0) n = blocks_per_sm(kernel, g.block(), smem);
  const unsigned grid = persistent_grid(a.rows, g, n);
  kernel<<<grid, g.block(), smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<T*>(a.y),
      static_cast<T*>(a.y2), a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags,
      g.team_log, a.rstd_out);
}

// Whether rows of H elements fill a team of 2**team_log threads exactly with NP
// vectors per thread: the rows the constant-geometry forms take.
template <typename T, int NP>
inline bool fills_team(long long H, int team_log) {
  return H == (static_cast<long long>(NP) * VecOf<T>::value << team_log);
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

// The persistent forward. Gate-table launches of rows that fill the team
// exactly (bf16, one or two passes over teams of 4..32 lanes: H = 32..512)
// run the constant-geometry form.
template <int OP, typename T, int NP>
void forward_pipe_t(const LaunchArgs& a, const PipeGeometry& g, cudaStream_t stream) {
  constexpr int VEC = VecOf<T>::value;
  const bool table =
      use_gate_table<OP, T>(a) &&
      fits_smem(pipe_weight_bytes(g, VEC) + GATE_TABLE_SLOTS * sizeof(float),
                device_smem_optin());
  if constexpr (OP == OP_GATED && IsBf16<T>::value && NP <= 2) {
    if (table && fills_team<T, NP>(a.H, g.team_log) &&
        with_team_log<2, 5>(g.team_log, [&](auto tl) {
          launch_fwd_pipe<OP, T, NP, decltype(tl)::value>(a, g, true, stream);
        }))
      return;
  }
  launch_fwd_pipe<OP, T, NP, -1>(a, g, table, stream);
}

template <int OP, typename T, int NP, int FULL_TL, bool GT = false, int GTF = 0>
void launch_row(LaunchArgs a, const PipeGeometry& g, cudaStream_t stream,
                const float* gtab = nullptr) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  const int block = row_block(g, a.rows);
  const unsigned grid = grid_for(a.rows, block >> g.team_log);
  normspec_fwd_row_kernel<OP, T, NP, FULL_TL, GT, GTF><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<T*>(a.y),
      static_cast<T*>(a.y2), a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags,
      g.team_log, a.rstd_out, gtab);
}

// ---- the gated forward one row per team, with a gate table in global memory ------------
// Large bf16 gated forwards run the one-row kernel with act(z) read from a gate table in
// global memory (normspec_fwd_row_kernel's GT) instead of the persistent kernel with its
// per-block table in shared memory, which is slower on large launches. The
// table (both activations) is a device variable of this translation unit, filled once
// per process and device by a synchronous launch on the caller's stream; while a stream
// is being captured into a CUDA graph it is not filled, and such a launch keeps the
// persistent kernel.
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
// The GT form of a launch (normspec_fwd_row_kernel's GTF): each convention in a form of
// its own, with the convention, and whether the weight is read in the input dtype
// (F_W_RAW), as compile-time constants, which leaves their run-time branches (and, for
// the transformers convention with a bf16 weight, the widened weight product: form 5
// takes it in packed bf16) out of the kernel.
inline int gt_form_of(const LaunchArgs& a) {
  if (!(a.flags & F_HF)) return a.w_in_dtype != nullptr ? 4 : 1;
  if (!(a.flags & F_W_IS_INPUT)) return 2;
  return a.w_in_dtype != nullptr ? 5 : 3;
}

// The gated forward through the global table where the row geometry is a two-pass
// constant form (rows of 64..1024 bf16); returns whether it ran.
template <int OP, typename T>
bool forward_row_with_global_table(const LaunchArgs& a, cudaStream_t stream) {
  if constexpr (OP == OP_GATED && IsBf16<T>::value) {
    if (!(a.flags & F_ALIGNED) || !use_gate_table<OP, T>(a) || !row_index_fits_32(a.rows))
      return false;
    const PipeGeometry g = row_geometry(a.H, VecOf<T>::value, true, a.rows);
    if (g.np != 2 || !fills_team<T, 2>(a.H, g.team_log)) return false;
    const float* tab = global_gate_table<T>((a.flags & F_SIGMOID) != 0, stream);
    if (tab == nullptr) return false;
    const int form = gt_form_of(a);
    return with_team_log<2, 6>(g.team_log, [&](auto tl) {
      constexpr int TL = decltype(tl)::value;
      switch (form) {
        case 1:
          return launch_row<OP, T, 2, TL, true, 1>(a, g, stream, tab);
        case 2:
          return launch_row<OP, T, 2, TL, true, 2>(a, g, stream, tab);
        case 3:
          return launch_row<OP, T, 2, TL, true, 3>(a, g, stream, tab);
        case 4:
          return launch_row<OP, T, 2, TL, true, 4>(a, g, stream, tab);
        default:
          return launch_row<OP, T, 2, TL, true, 5>(a, g, stream, tab);
      }
    });
  } else {
    static_cast<void>(a), static_cast<void>(stream);
    return false;
  }
}

// The q/k forward in vectors of four (normspec_fwd_quad_kernel): the one-pass rms and
// fused forwards of 16-bit rows of 256 (teams of 32 lanes: two warps a row) and 128 (16:
// one warp) with a weight read as it is, in 256-thread blocks, where the launch has at
// most 128 of its threads an SM (256 rows of 256 or 512 of 128 on an H200): faster than
// the warp teams' one-pass form there, slower past that bound.
// log2 of the quad form's lanes a row for this launch, 0 where it does not apply
template <int OP, typename T>
int quad_lanes_log(const LaunchArgs& a, const PipeGeometry& g) {
  if (sizeof(T) != 2 || OP == OP_GATED ||
      a.w_in_dtype == nullptr || !(a.flags & F_ALIGNED))  // F_ALIGNED: the weight's too
    return 0;
  const int ll = a.H == 256 && g.team_log == 5 ? 6 : (a.H == 128 && g.team_log == 4 ? 5 : 0);
  if (ll == 0 || (a.rows << ll) > static_cast<long long>(device_sms()) * 128) return 0;
  return ll;
}
template <int OP, typename T>
bool launch_quad(LaunchArgs a, const PipeGeometry& g, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2 && OP != OP_GATED) {
    const int ll = quad_lanes_log<OP, T>(a, g);
    if (ll == 0) return false;
    const void* w = nullptr;
    take_pipe_weight(a, w);  // the weight as it is, F_W_RAW set as for the row kernels
    constexpr int block = 256;
    const unsigned grid = grid_for(a.rows, block >> ll);
    auto go = [&](auto kernel) {
      kernel<<<grid, block, 0, stream>>>(
          static_cast<const T*>(a.x), static_cast<const T*>(a.r), static_cast<const T*>(w),
          static_cast<T*>(a.y), static_cast<T*>(a.y2),
          static_cast<int>(a.rows), a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags,
          a.rstd_out);
    };
    if (ll == 6) {
      go(normspec_fwd_quad_kernel<OP, T, 6>);
    } else {
      go(normspec_fwd_quad_kernel<OP, T, 5>);
    }
    return true;
  }
  static_cast<void>(a), static_cast<void>(g), static_cast<void>(stream);
  return false;
}

// Rows that fill the team exactly with the default passes (power-of-two H) run
// the form with constant geometry (FULL_TL = team_log, teams of 2..256 threads);
// other rows the general one.
template <int OP, typename T, int NP>
void forward_row_t(const LaunchArgs& a, const PipeGeometry& g, cudaStream_t stream) {
  constexpr int DEFAULT_NP = OP == OP_RMS ? 4 : 2;
  if constexpr (NP == DEFAULT_NP) {
    if (row_index_fits_32(a.rows) && fills_team<T, NP>(a.H, g.team_log) &&
        with_team_log<1, 8>(g.team_log, [&](auto tl) {
          launch_row<OP, T, NP, decltype(tl)::value>(a, g, stream);
        }))
      return;
  }
  // The small-row geometry (one vector per thread, teams of 16..256 lanes) of
  // power-of-two rows (128..2048 bf16, 64..1024 fp32 elements): these launches are
  // bound by one row's latency, which the constant forms shorten (less than half the
  // instructions of the general form).
  if constexpr (NP == 1) {
    if (launch_quad<OP, T>(a, g, stream)) return;
    if (row_index_fits_32(a.rows) && fills_team<T, 1>(a.H, g.team_log) &&
        with_team_log<4, 8>(g.team_log, [&](auto tl) {
          launch_row<OP, T, 1, decltype(tl)::value>(a, g, stream);
        }))
      return;
  }
  launch_row<OP, T, NP, -1>(a, g, stream);
}

// The backward's dynamic shared memory without the gate table: the dweight stacks
// and the weight factors.
template <typename T>
size_t bwd_pipe_base_bytes(const BackwardPlan& plan) {
  PipeGeometry g;
  g.team_log = plan.team_log;
  g.np = plan.np;
  constexpr int VEC = VecOf<T>::value;
  return pipe_stack_bytes(g, VEC, plan.glog) + pipe_weight_bytes(g, VEC);
}

// Whether the backward reads act(z) and act'(z) from the gate table.
template <int OP, typename T>
bool bwd_gate_table(const LaunchArgs& a, const BackwardPlan& plan) {
  return use_gate_table<OP, T>(a) &&
         fits_smem(bwd_pipe_base_bytes<T>(plan) + GATE_TABLE_SLOTS * sizeof(float2),
                   device_smem_optin());
}

template <int OP, typename T, int NP, int FULL_TL, bool SAVED, int GC = -1>
void launch_bwd_pipe_as(LaunchArgs a, float* ws, const BackwardPlan& plan, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  static int occ[9][MAX_PIPE_GLOG + 1][2] = {{{0}}};
  PipeGeometry g;
  g.team_log = plan.team_log;
  g.np = plan.np;
  static bool opted[64] = {false};
  const size_t base = bwd_pipe_base_bytes<T>(plan);
  // GC >= 0: the caller checked bwd_gate_table
  const bool table = GC >= 0 || bwd_gate_table<OP, T>(a, plan);
  if (table) a.flags |= F_GATE_TABLE;
  const size_t smem = base + (table ? GATE_TABLE_SLOTS * sizeof(float2) : 0);
  auto kernel = normspec_bwd_pipe_kernel<OP, T, NP, FULL_TL, SAVED, GC>;
  if (needs_optin(smem)) allow_smem_once(kernel, opted);
  int& n = occ[g.team_log][plan.glog][table];
  if (n == 0) n = blocks_per_sm(kernel, g.block(), smem);
  const unsigned grid = persistent_grid(plan.groups, g, n);
  kernel<<<grid, g.block(), smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<const T*>(a.dy),
      static_cast<const T*>(a.dres), static_cast<T*>(a.y), static_cast<T*>(a.y2), ws, a.rows,
      a.H, a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2, a.eps, a.offset, a.flags, plan.team_log,
      plan.glog, SAVED ? a.rstd_in : nullptr);
}


// normspec_gated_bwd_pair_kernel for a plan of groups of two rows or more: the
// persistent grid of the pipelined kernel, its shared memory less the bottom stack level
// and the weight factors (kept in registers).
template <typename T, int FULL_TL, int GC>
void launch_gated_bwd_pair(LaunchArgs a, float* ws, const BackwardPlan& plan,
                           cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);
  PipeGeometry g;
  g.team_log = plan.team_log;
  g.np = plan.np;
  static int occ[MAX_PIPE_GLOG + 1] = {0};
  static bool opted[64] = {false};
  constexpr int VEC = VecOf<T>::value;
  const size_t smem = static_cast<size_t>(plan.glog - 1) * VEC * sizeof(float) * 256 +
                      GATE_TABLE_SLOTS * sizeof(float2);
  auto kernel = normspec_gated_bwd_pair_kernel<T, FULL_TL, GC>;
  if (needs_optin(smem)) allow_smem_once(kernel, opted);
  int& n = occ[plan.glog];
  if (n == 0) n = blocks_per_sm(kernel, g.block(), smem);
  const unsigned grid = persistent_grid(plan.groups, g, n);
  kernel<<<grid, g.block(), smem, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.r), w, static_cast<const T*>(a.dy),
      static_cast<T*>(a.y), static_cast<T*>(a.y2), ws, static_cast<int>(a.rows),
      static_cast<int>(a.sx), static_cast<int>(a.sr), static_cast<int>(a.sdy),
      static_cast<int>(a.sy), static_cast<int>(a.sy2), a.offset, a.flags, plan.glog,
      static_cast<int>(plan.groups), a.rstd_in);
}

// The one-row rms backward of 128 threads x 2 passes (H = 256 vectors: 2048 bf16 /
// fp16, 1024 fp32) runs as 256 threads x 1 pass (normspec_bwd_row_kernel<T, 1, 8>) where
// its blocks fit the device at once (at most 8 per SM: rows <= SMs x 8): about half the
// instructions a warp on the few-row chain, for a cross-warp fold of eight partials
// instead of four. The same device functions and tree: the same bits. Past that bound
// the wide form was not faster.
inline bool bwd_row_wide(const LaunchArgs& a) { return a.rows <= 8LL * device_sms(); }

template <typename T, int NP, int FULL_TL, bool SAVED>
void launch_bwd_row(LaunchArgs a, float* ws, cudaStream_t stream) {
  const void* w = nullptr;
  take_pipe_weight(a, w);  // sets F_W_RAW in a.flags
  PipeGeometry g;
  g.team_log = FULL_TL;
  g.np = NP;
  const unsigned grid = grid_for(a.rows, static_cast<int>(g.teams_per_block()));
  normspec_bwd_row_kernel<T, NP, FULL_TL, SAVED><<<grid, g.block(), 0, stream>>>(
      static_cast<const T*>(a.x), w, static_cast<const T*>(a.dy), static_cast<T*>(a.y), ws,
      a.rows, a.sx, a.sdy, a.sy, a.eps, a.offset, a.flags, SAVED ? a.rstd_in : nullptr);
}

// The kernel that reads the given rstd where there is one (a.rstd_in), else the
// one that computes it: two instantiations, so that neither carries the other's
// registers (one kernel with a runtime switch lost a resident block per SM).
//
// The rms backward of one-row groups (glog = 0) in the constant geometries runs
// normspec_bwd_row_kernel (no group loop, stacks or prefetch: these launches are bound
// by one row's latency).
//
// The saved-rstd constant forms of the bf16 gated op with the gate table (the GDN
// norm's 128 and 256 lanes) take the convention as constants (GC), which leaves
// the per-element convention branches out of the hot loop; the transformers
// convention with a weight of the input dtype takes its weight products in packed bf16
// (GC 7). Where the plan's groups have two rows or more and every offset fits 32 bits,
// they run normspec_gated_bwd_pair_kernel, two rows a team per iteration.
template <int OP, typename T, int NP, int FULL_TL>
void launch_bwd_pipe(const LaunchArgs& a, float* ws, const BackwardPlan& plan,
                     cudaStream_t stream) {
  if constexpr (OP == OP_RMS && FULL_TL >= 0) {
    if (plan.glog == 0) {
      if constexpr (NP == 2 && FULL_TL == 7) {
        if (bwd_row_wide(a)) {
          if (a.rstd_in != nullptr) return launch_bwd_row<T, 1, 8, true>(a, ws, stream);
          return launch_bwd_row<T, 1, 8, false>(a, ws, stream);
        }
      }
      if (a.rstd_in != nullptr) return launch_bwd_row<T, NP, FULL_TL, true>(a, ws, stream);
      return launch_bwd_row<T, NP, FULL_TL, false>(a, ws, stream);
    }
  }
  if constexpr (OP == OP_GATED && IsBf16<T>::value && NP == 1 && FULL_TL >= 0) {
    if (a.rstd_in != nullptr && bwd_gate_table<OP, T>(a, plan)) {
      const bool pair = plan.glog >= 1 && offsets_fit_32(a);
      auto launch_gc = [&](auto gc) {
        constexpr int GC = decltype(gc)::value;
        if (pair) return launch_gated_bwd_pair<T, FULL_TL, GC>(a, ws, plan, stream);
        launch_bwd_pipe_as<OP, T, NP, FULL_TL, true, GC>(a, ws, plan, stream);
      };
      if (!(a.flags & F_HF)) return launch_gc(std::integral_constant<int, 0>());
      if (!(a.flags & F_W_IS_INPUT)) return launch_gc(std::integral_constant<int, 1>());
      return launch_gc(std::integral_constant<int, 7>());
    }
  }
  if (a.rstd_in != nullptr)
    return launch_bwd_pipe_as<OP, T, NP, FULL_TL, true>(a, ws, plan, stream);
  launch_bwd_pipe_as<OP, T, NP, FULL_TL, false>(a, ws, plan, stream);
}

// Full rows (H = NP * VEC * 2**team_log) of the common default geometries run the
// constant-geometry backward: one pass at 16 and 32 lanes (H = 128 and 256 bf16),
// two passes at 128 and 256 threads (H = 2048 and 4096 bf16, 2048 fp32).
template <int OP, typename T, int NP>
void backward_pipe_t(const LaunchArgs& a, float* ws, const BackwardPlan& plan,
                     cudaStream_t stream) {
  constexpr int LO = NP == 1 ? 4 : 7;  // the constant forms: team_log LO and LO + 1
  if constexpr (NP <= 2) {
    if (fills_team<T, NP>(a.H, plan.team_log) &&
        with_team_log<LO, LO + 1>(plan.team_log, [&](auto tl) {
          launch_bwd_pipe<OP, T, NP, decltype(tl)::value>(a, ws, plan, stream);
        }))
      return;
  }
  launch_bwd_pipe<OP, T, NP, -1>(a, ws, plan, stream);
}

// Which forward kernel family a call runs on (alignment already set).
enum ForwardKind { FWD_REGISTER, FWD_ROW, FWD_PIPE };
inline ForwardKind forward_kind(int op, bool bf16, const LaunchArgs& a, int vec) {
  if (!(a.flags & F_ALIGNED)) return FWD_REGISTER;
  if (!wants_gate_table(op, bf16, a) && row_geometry(a.H, vec, op != OP_RMS, a.rows).np > 0)
    return FWD_ROW;
  if (pipe_geometry(a.H, vec, false).np > 0) return FWD_PIPE;
  return FWD_REGISTER;
}

template <int OP, typename T>
void forward_t(const LaunchArgs& a, cudaStream_t stream) {
  if (forward_row_with_global_table<OP, T>(a, stream)) return;
  const ForwardKind kind = forward_kind(OP, IsBf16<T>::value, a, VecOf<T>::value);
  if (kind == FWD_ROW) {
    const PipeGeometry rg = row_geometry(a.H, VecOf<T>::value, OP != OP_RMS, a.rows);
    switch (rg.np) {
      case 1:
        return forward_row_t<OP, T, 1>(a, rg, stream);
      case 2:
        return forward_row_t<OP, T, 2>(a, rg, stream);
      case 4:
        return forward_row_t<OP, T, 4>(a, rg, stream);
      default:
        break;
    }
  }
  if (kind == FWD_PIPE) {
    const PipeGeometry pg = pipe_geometry(a.H, VecOf<T>::value, false);
    switch (pg.np) {
      case 1:
        return forward_pipe_t<OP, T, 1>(a, pg, stream);
      case 2:
        return forward_pipe_t<OP, T, 2>(a, pg, stream);
      case 4:
        return forward_pipe_t<OP, T, 4>(a, pg, stream);
      default:
        break;
    }
  }
  const Geometry g = geometry(a.H, VecOf<T>::value);
  const int tpb = g.threads == 32 ? 4 : 1;
  const dim3 block(g.threads, tpb);
  const dim3 grid(grid_for(a.rows, tpb));
  const T* x = static_cast<const T*>(a.x);
  const T* r = static_cast<const T*>(a.r);
  T* y = static_cast<T*>(a.y);
  T* y2 = static_cast<T*>(a.y2);
#define NS_FWD_ARGS \
  x, r, a.w, y, y2, a.rows, a.H, a.sx, a.sr, a.sy, a.sy2, a.eps, a.offset, a.flags, a.rstd_out
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
  if (plan.pipe) {
    switch (plan.np) {
      case 1:
        return backward_pipe_t<OP, T, 1>(a, ws, plan, stream);
      case 2:
        return backward_pipe_t<OP, T, 2>(a, ws, plan, stream);
      default:
        return backward_pipe_t<OP, T, 4>(a, ws, plan, stream);
    }
  }
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
