// The launch machinery of the normspec CUDA kernels (torch-free), shared by
// normspec_launch.cu (the entry points of normspec_launch.h) and the launch units
// launch_units/<dtype>_<op>_<direction>.cu, each of which instantiates one forward_t or
// backward_t (NORMSPEC_FORWARD_UNIT, NORMSPEC_BACKWARD_UNIT), so that a build compiles
// them side by side: 21 units of at most ~27 s (the bf16 gated backward) where the three
// per-dtype units they replace took ~95 s each, one core apiece.
//
// Geometry: a team of `threads` threads (a power of two, 32..1024) handles a
// row; rows whose padded length fits in registers use the register kernels
// with NP passes, longer rows the streaming kernels.
//
// Tuning override (read once per process, at the first launch or plan):
//   NORMSPEC_FWD_TEAM=<threads>  (a power of two, 1..1024)
//   NORMSPEC_BWD_TEAM=<threads>  (a power of two, 1..256: the backward kernel's bound)
//   NORMSPEC_BWD_ROW=0  (the pipelined rms backward also for one-row groups in the
//                        constant geometries, not the one-row kernel; bwd_row_enabled)
//   NORMSPEC_BWD_ROW_WIDE=0  (that one-row rms backward of rows of 256 vectors as 128
//                             threads x 2 passes, not 256 x 1; bwd_row_wide)
//   NORMSPEC_BWD_ROW_WIDE=2  (an experiment: the 256 x 1 form past its row bound too)
//   NORMSPEC_FWD_ROW=0  (the persistent pipelined forward, not one row per team)
//   NORMSPEC_FULL_ROW=0  (the general-geometry kernels also for rows that fill
//                         the team exactly, instead of the constant-geometry forms)
//   NORMSPEC_SAVED_RSTD=0  (the backward recomputes rstd instead of reading the
//                           forward's, a.rstd_in)
//   NORMSPEC_ROW_BLOCK=<threads>  (threads per block of the one-row forward for teams
//                                  of at most 32 lanes: a power of two, 32..256;
//                                  default: row_block)
//   NORMSPEC_ROW_QUAD=0  (the one-pass rms and fused forwards of few 16-bit rows of 256
//                         and 128 in the warp teams' form, not in vectors of four;
//                         launch_quad)
//   NORMSPEC_GATED_ROW_TABLE=0  (large bf16 gated forwards on the persistent kernel
//                                with a gate table per block in shared memory, instead
//                                of one row per team reading a table in global memory;
//                                forward_row_with_global_table)
//   NORMSPEC_GT_VLLM_FORM=0  (the vllm convention's GT forward in the form of both
//                             conventions, not in its own; gt_vllm_form_enabled)
//   NORMSPEC_GT_HF_FORM=0  (the transformers convention's GT forward in the form of both
//                           conventions, not in its own; gt_hf_form_enabled)
//   NORMSPEC_GT_VLLM_W_RAW=0  (the vllm GT form for a weight read in the input dtype
//                              without that as a constant; gt_vllm_w_raw_enabled)
//   NORMSPEC_GT_HF_PACKED_W=0  (the hf GT form for a bf16 weight with its product in fp32
//                               and a rounding, not in packed bf16; gt_hf_packed_w_enabled)
//   NORMSPEC_GATED_BWD_PACKED_W=0  (the hf gated backward's constant form for a bf16
//                                   weight with its two weight products in fp32 and a
//                                   rounding, not in packed bf16; gated_bwd_packed_w_enabled)
// replace the team size (the pipelined kernels take 1..256 threads, the
// register kernels 32 and more); NP is then the smallest of 1, 2, 4 with
// NP * threads * VEC >= H, and where none fits the default geometry
// (possibly the streaming kernel) is kept. Every geometry gives the
// same bits (the reductions follow the spec's tree by index). Invalid values
// are ignored with one warning on stderr.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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

inline Geometry default_geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 1024) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 2048) return {1024, 2};
  if (nvec <= 4096) return {1024, 4};
  return {1024, 0};
}

// The backward keeps more per element (dxhat, the dweight stacks): teams of
// at most 256 threads.
inline Geometry default_backward_geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 256) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 512) return {256, 2};
  if (nvec <= 1024) return {256, 4};
  return {1024, 0};
}

// Whether environment variable `name` is exactly the one character `value`.
inline bool env_is(const char* name, char value) {
  const char* s = std::getenv(name);
  return s != nullptr && s[0] == value && s[1] == '\0';
}
// Whether environment variable `name` is exactly "0": the speed switches that keep an
// older code path for timing (read once by each caller).
inline bool switched_off(const char* name) { return env_is(name, '0'); }

// The team size in environment variable `name` (0 = unset or invalid).
inline int team_from_env(const char* name, int max_threads) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s, &end, 10);
  if (errno == 0 && end != s && *end == '\0' && v >= 1 && v <= max_threads &&
      (v & (v - 1)) == 0)
    return static_cast<int>(v);
  std::fprintf(stderr,
               "normspec: ignoring %s=%s (expected a power of two in 1..%d); "
               "using the default geometry\n",
               name, s, max_threads);
  return 0;
}

inline int forward_team_override() {
  static const int threads = team_from_env("NORMSPEC_FWD_TEAM", 1024);
  return threads;
}

inline int backward_team_override() {
  static const int threads = team_from_env("NORMSPEC_BWD_TEAM", 256);
  return threads;
}

// Threads per block of the one-row forward where its teams share warps (0 = unset:
// row_block). torch.compile's q/k forward runs one-warp blocks of four rows (ncu,
// bench/results/ncu/torch_compile_H200.csv); this lets a sweep time ours that way.
inline int row_block_override() {
  static const int threads = [] {
    const int t = team_from_env("NORMSPEC_ROW_BLOCK", 256);
    if (t != 0 && t < 32) {
      std::fprintf(stderr, "normspec: ignoring NORMSPEC_ROW_BLOCK=%d (expected a power of two "
                           "in 32..256); using 256\n", t);
      return 0;
    }
    return t;
  }();
  return threads;
}

// The deepest dweight stacks a launch may ask for (NORMSPEC_BWD_GLOG); the plan's
// own choice stays within pipe_max_glog (five levels, 40 KiB).
constexpr int MAX_FORCED_GLOG = 7;

// NORMSPEC_BWD_GLOG=<0..7>: rows per dweight group (log2) of the pipelined
// backward, capped by what its shared memory can hold (pipe_forced_glog_cap) and
// by the rows' next power of two (backward_plan_for; -1 = unset: the plan decides,
// within pipe_max_glog).
inline int group_log_override() {
  static const int glog = [] {
    const char* s = std::getenv("NORMSPEC_BWD_GLOG");
    if (s == nullptr || *s == '\0') return -1;
    if (s[1] == '\0' && s[0] >= '0' && s[0] <= '0' + MAX_FORCED_GLOG) return s[0] - '0';
    std::fprintf(stderr, "normspec: ignoring NORMSPEC_BWD_GLOG=%s (expected 0..%d)\n", s,
                 MAX_FORCED_GLOG);
    return -1;
  }();
  return glog;
}

// `threads` per team with the fewest passes (1, 2 or 4) that cover H; `fallback`
// when there is no override or no pass count fits.
inline Geometry with_team(int threads, long long H, int vec, Geometry fallback) {
  if (threads < 32) return fallback;  // unset, or a team only the pipelined kernels take
  for (int np = 1; np <= 4; np *= 2)
    if (static_cast<long long>(np) * threads * vec >= H) return {threads, np};
  return fallback;
}

inline Geometry geometry(long long H, int vec) {
  return with_team(forward_team_override(), H, vec, default_geometry(H, vec));
}

// backward_plan and the launch both use this (the plan's glog bound and
// blocks per SM follow the team).
inline Geometry backward_geometry(long long H, int vec) {
  return with_team(backward_team_override(), H, vec, default_backward_geometry(H, vec));
}

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
// NP <= 4); NORMSPEC_PIPE=0 turns them off (the register / streaming kernels
// above then run everything, as before).
inline bool pipe_enabled() {
  static const bool on = !switched_off("NORMSPEC_PIPE");
  return on;
}

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

// threads per team from the override (0: default), NP the fewest passes that cover H.
// Defaults (H200 sweeps, bench/results/sweeps/): two passes per thread from 17
// vectors on in the forward (H = 128 bf16 gated with the gate table, constant-geometry
// forms: 16 lanes x 1 423.7 us against 434.5 for 8 x 2, gated_forward_one_pass.json;
// the general forms had 8 x 2 ahead, 3.19 vs 2.94 TB/s) and from 33 vectors on in
// the backward (H = 256: 32 x 1 beat 16 x 2, 2.87 vs
// 2.48 TB/s); teams of 1..32 lanes share warps; 256 x 4 for 513..1024 vectors.
inline PipeGeometry pipe_geometry(long long H, int vec, int override_threads,
                                  bool backward) {
  PipeGeometry g;
  if (!pipe_enabled()) return g;
  const long long nvec = (H + vec - 1) / vec;
  const long long one_pass = backward ? 32 : 16;  // up to this many vectors: one pass
  long long threads;
  if (override_threads > 0) {
    threads = override_threads;
  } else if (nvec <= one_pass) {
    threads = next_pow2(nvec);
  } else if (nvec <= 512) {
    threads = next_pow2(nvec) / 2;
  } else {
    threads = 256;
  }
  return with_passes(threads, H, vec);
}

// NORMSPEC_FWD_ROW=0: the persistent pipelined forward everywhere (default:
// the one-row-per-team kernel wherever the gate table is not used).
inline bool row_forward_enabled() {
  static const bool on = !switched_off("NORMSPEC_FWD_ROW");
  return on;
}

// NORMSPEC_FULL_ROW=0: no constant-geometry forms (default: rows that fill the
// team exactly run the forms whose geometry predicates fold away at compile time).
inline bool full_row_forms_enabled() {
  static const bool on = !switched_off("NORMSPEC_FULL_ROW");
  return on;
}

// The one-row forward's constant forms index their row in 32 bits where teams are at most
// a warp (SLOT32 in normspec_fwd_row_kernel) and by blockIdx.x above that: more rows than
// 2^31 - 1 (which no output fits on today's devices) take the general form.
inline bool row_index_fits_32(long long rows) { return rows <= 0x7fffffffLL; }

// NORMSPEC_BWD_OFF32 (normspec_pipe.cuh): the pipelined backward's constant forms then do
// their row, group and offset arithmetic in int, so they take a launch only where every
// element offset of its tensors (and of the workspace's group rows) and every row and
// group index, with the team's slots past the last one, stays below 2^31: at most 2^30
// rows (the persistent grid's teams past them add at most SMs x 2048 x 8 rows: teams of 16+
// lanes, groups of at most 128 rows; within 2^31 for fewer than 65536 SMs), and the last
// row's last element, (rows - 1) * (the largest stride, or H) + H - 1, at most 2^31 - 2.
// Always true where the switch is off (the forms' arithmetic is then 64-bit). A launch past
// the bound also leaves the one-row rms backward (launch_bwd_row, 64-bit) for the general
// form: slower, the same bits.
// offsets_fit_32 is that bound itself (normspec_gated_bwd_pair_kernel's, unconditionally).
inline bool offsets_fit_32(const LaunchArgs& a) {
  long long m = a.H;
  for (long long s : {a.sx, a.sr, a.sdy, a.sdres, a.sy, a.sy2}) m = s > m ? s : m;
  return a.rows <= (1LL << 30) && m <= 0x7fffffffLL &&
         (a.rows - 1) * m <= 0x7fffffffLL - a.H;
}
inline bool bwd_offsets_fit_32(const LaunchArgs& a) {
#if NORMSPEC_BWD_OFF32
  return offsets_fit_32(a);
#else
  static_cast<void>(a);
  return true;
#endif
}

// NORMSPEC_SAVED_RSTD=0: the pipelined backward recomputes rstd even where the
// forward's is given (a.rstd_in; default: it reads the given one). Same bits.
inline bool saved_rstd_enabled() {
  static const bool on = !switched_off("NORMSPEC_SAVED_RSTD");
  return on;
}
inline const float* saved_rstd(const LaunchArgs& a) {
  return saved_rstd_enabled() ? a.rstd_in : nullptr;
}

inline int device_sms();

// The one-row-per-team forward: by default four vectors per thread for the rms
// norm and two for the ops that read two row tensors (H200,
// bench/micro/fwd_variants.cu, H = 2048 bf16: rms 64 x 4 72.1 us against 76.3 for
// 128 x 2 and 97.0 for 256 x 1; fused 128 x 2 138.9 us, 64 x 4 139.9 with 88
// instead of 56 registers), the team override otherwise.
// Few rows: a launch that cannot fill the GPU is bound by the latency of one
// row, which shortens with the vectors each thread walks; the team doubles (to
// one vector per thread at most) while the teams' threads stay within half the
// device's resident threads (SMs x 1024), so a full launch keeps the geometry
// above. H200, 2048 bf16: 64 rows 5.2 us with teams of 256 against 6.0 with 64,
// 4096 rows 13.9 with 64 against 19.1 with 256 (bench/results/sweeps/small_rows.json).
inline PipeGeometry row_geometry(long long H, int vec, int override_threads,
                                 bool two_inputs, long long rows) {
  if (!pipe_enabled() || !row_forward_enabled()) return PipeGeometry{};
  const long long nvec = (H + vec - 1) / vec;
  if (override_threads > 0) return with_passes(override_threads, H, vec);
  const long long per_thread = two_inputs ? 2 : 4;
  long long threads = next_pow2(nvec) / per_thread;
  if (threads > 256) threads = 256;  // then more passes
  if (threads < 1) threads = 1;
  const long long one_vector = next_pow2(nvec) < 256 ? next_pow2(nvec) : 256;
  const long long resident_half = static_cast<long long>(device_sms()) * 1024;
  while (threads < one_vector && rows * threads * 2 <= resident_half) threads *= 2;
  return with_passes(threads, H, vec);
}

// NORMSPEC_ROW_BLOCK_SPREAD=1 (run time, default off; an experiment, notes/perf.md §35):
// where teams of at most a warp fill fewer 256-thread blocks than the device has SMs, the
// one-row forward runs 64-thread blocks, so that the rows spread over four times as many
// SMs. On the H200, warm (1 MiB flush; one process, 2 rounds, equal hashes;
// bench/results/sweeps/qk_row_block_7327fa8.json): 64 x 256 bf16 3.62 -> 3.49 us with
// NORMSPEC_ROW_BLOCK=64 (4096 x 256, which this leaves at 256: 4.40 -> 5.15 with 64).
// The CuPy backend's row_block reads it too (test_row_block_spread_matches_the_cpp_launcher).
// Through the whole torch extension it did not pay (session 31, bench/repeat.py, three
// processes, 1 MiB flush; bench/results/repeat/qk_64x256_warm_flush_1mib*_ee94569.json):
// 64 x 256 forward 4.26 [4.19-4.35] us with it against 4.19 [4.19-4.42] without, so it
// stays off (its run in the bench's protocol outlived its time limit: not measured).
inline bool row_block_spread() {
  static const bool on = env_is("NORMSPEC_ROW_BLOCK_SPREAD", '1');
  return on;
}

// Threads per block of the one-row forward: one team for teams of 64 and more
// lanes; for smaller teams (sharing warps) 256 threads, or one warp where the
// launch runs many waves: its teams' threads at least 8 times the device's
// resident threads (SMs x 2048). H200, q/k rows of 256 bf16 (teams of 8),
// 524288 rows: 141.0 us in one-warp blocks against 145.7 in 256-thread ones
// (bench/results/sweeps/fused_from_sum_rowblock.json); 16384 rows: 10.4 against
// 9.3, and 4096 rows with the small-row teams of 32 lanes: 8.2 against 6.5
// (bench/results/sweeps/small_rows.json). NORMSPEC_ROW_BLOCK overrides.
inline int row_block(const PipeGeometry& g, long long rows) {
  // a team of 64+ lanes is its block, one block per row: the one-row kernels' whole-block
  // forms take their row from blockIdx.x (PER_BLOCK in normspec_pipe.cuh), so this must stay
  if (g.team_log > 5) return 1 << g.team_log;
  if (row_block_override()) return row_block_override();
  const long long waves8 = static_cast<long long>(device_sms()) * 2048 * 8;
  if ((rows << g.team_log) >= waves8) return 32;
  if (row_block_spread() && (rows << g.team_log) < 256LL * device_sms()) return 64;
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
inline int pipe_glog_cap(const PipeGeometry& g, int vec, int optin, int levels,
                         size_t stack_budget) {
  const size_t weights = pipe_weight_bytes(g, vec);
  int l = 0;
  while (l < levels && pipe_stack_bytes(g, vec, l + 1) <= stack_budget &&
         fits_smem(pipe_stack_bytes(g, vec, l + 1) + weights, optin))
    ++l;
  return l;
}
inline int pipe_max_glog(const PipeGeometry& g, int vec, int optin) {
  return pipe_glog_cap(g, vec, optin, 5, 40960);
}
// A forced glog (NORMSPEC_BWD_GLOG) may go deeper, to what a block can opt in to:
// fewer workspace rows at the cost of resident blocks, for sweeps to weigh.
inline int pipe_forced_glog_cap(const PipeGeometry& g, int vec, int optin) {
  return pipe_glog_cap(g, vec, optin, MAX_FORCED_GLOG, static_cast<size_t>(optin));
}

// The gate table (bf16 gates of launches with at least this many elements:
// below it, filling the table costs more than it saves).
constexpr long long GATE_TABLE_MIN_ELEMENTS = 1LL << 20;
// NORMSPEC_GATE_TABLE=0 turns the table off (read once per process).
inline bool gate_table_enabled() {
  static const bool on = !switched_off("NORMSPEC_GATE_TABLE");
  return on;
}
inline bool wants_gate_table(int op, bool bf16, const LaunchArgs& a) {
  return op == OP_GATED && bf16 && a.rows * a.H >= GATE_TABLE_MIN_ELEMENTS &&
         gate_table_enabled();
}
template <int OP, typename T>
bool use_gate_table(const LaunchArgs& a) {
  return wants_gate_table(OP, IsBf16<T>::value, a);
}

// Sets `w` to the weight a pipelined kernel reads, and F_W_RAW in a.flags where that is
// the weight in the input dtype. It returns nothing so that it cannot sit in a launch's
// argument list next to a.flags: arguments are evaluated in no fixed order, and two
// experiments that called the former pointer-returning form there read a bf16 weight as
// fp32 (3a3ec32, f144765; notes/perf.md §22, §25).
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
    if (table && full_row_forms_enabled() && fills_team<T, NP>(a.H, g.team_log) &&
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
// per-block table in shared memory: on the H200 2^21 x 128 took 372.1 us against 394.2
// (vllm) and 378.1 against 399.4 (hf; bench/results/sweeps/gated_row_table.json).
// NORMSPEC_GATED_ROW_TABLE=0 keeps the persistent kernel. The table (both activations)
// is a device variable of this translation unit, filled once per process and device by
// a synchronous launch on the caller's stream; while a stream is being captured into a
// CUDA graph it is not filled, and such a launch keeps the persistent kernel.
inline bool gated_row_table_enabled() {
  static const bool on = !switched_off("NORMSPEC_GATED_ROW_TABLE");
  return on;
}
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
// The GT forward of the vllm convention in its own form (normspec_fwd_row_kernel's
// GT_VLLM) unless NORMSPEC_GT_VLLM_FORM=0, which gives it the form of both conventions.
// The bench on the H200, alternating processes: vllm forward 375.9-376.0 us against
// 378.1 (bench/results/probes/gt_vllm_form_bench_0df18fa.txt, notes §26).
inline bool gt_vllm_form_enabled() {
  static const bool on = !switched_off("NORMSPEC_GT_VLLM_FORM");
  return on;
}
// The GT forward of the transformers convention with its convention and weight dtype as
// constants (normspec_fwd_row_kernel's GTF 2 and 3), so that its extra roundings are not
// behind run-time flags, unless NORMSPEC_GT_HF_FORM=0. The bench on the H200, alternating
// processes: hf forward 378.3-378.8 us against 379.6-379.7 for the form of both
// (bench/results/probes/gt_hf_form_bench_a6db87b.txt, notes §27).
inline bool gt_hf_form_enabled() {
  static const bool on = !switched_off("NORMSPEC_GT_HF_FORM");
  return on;
}
// The vllm convention's GT form for a weight read in the input dtype (take_pipe_weight
// sets F_W_RAW) with that as a constant too (normspec_fwd_row_kernel's GTF 4), so that the
// fp32 weight's load path (predicated in form 1) drops out of the kernel (ptxas: no spill,
// 22 LDG against 26), unless NORMSPEC_GT_VLLM_W_RAW=0. The bench on the H200, alternating
// processes: vllm forward 375.2-375.3 us against 375.7-376.3 (call), 376.1-376.5 against
// 376.6-377.5 (device) (bench/results/probes/gt_w_raw_packed_w_bench_cda5123.txt, §28).
inline bool gt_vllm_w_raw_enabled() {
  static const bool on = !switched_off("NORMSPEC_GT_VLLM_W_RAW");
  return on;
}
// The hf convention's GT form for a bf16 weight read as it is (GTF 5) takes
// rt(rt(v * rstd) * w) as packed bf16 products (mul_rn_bf16x2; forward_gated_hf_packed_w
// says why the bits are the same) instead of widening the weight and rounding the fp32
// product, about three fewer instructions per element, unless NORMSPEC_GT_HF_PACKED_W=0.
// The bench on the H200, alternating processes: hf forward 374.4-374.7 us against
// 379.2-380.3 (call), 375.4-375.5 against 381.2-381.3 (device), now level with
// torch.compile's 374.5-375.1 (bench/results/probes/gt_w_raw_packed_w_bench_cda5123.txt).
inline bool gt_hf_packed_w_enabled() {
  static const bool on = !switched_off("NORMSPEC_GT_HF_PACKED_W");
  return on;
}
// The GT form of a launch (normspec_fwd_row_kernel's GTF).
inline int gt_form_of(const LaunchArgs& a) {
  if (!(a.flags & F_HF)) {
    if (!gt_vllm_form_enabled()) return 0;
    return a.w_in_dtype != nullptr && gt_vllm_w_raw_enabled() ? 4 : 1;
  }
  if (!gt_hf_form_enabled()) return 0;
  if (!(a.flags & F_W_IS_INPUT)) return 2;
  return a.w_in_dtype != nullptr && gt_hf_packed_w_enabled() ? 5 : 3;
}

// The gated forward through the global table where it is not switched off and the row
// geometry is a two-pass constant form (rows of 64..1024 bf16); returns whether it ran.
template <int OP, typename T>
bool forward_row_with_global_table(const LaunchArgs& a, cudaStream_t stream) {
  if constexpr (OP == OP_GATED && IsBf16<T>::value) {
    if (!gated_row_table_enabled() || !(a.flags & F_ALIGNED) || !use_gate_table<OP, T>(a) ||
        !full_row_forms_enabled() || !row_index_fits_32(a.rows))
      return false;
    const PipeGeometry g = row_geometry(a.H, VecOf<T>::value, forward_team_override(), true,
                                        a.rows);
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
        case 5:
          return launch_row<OP, T, 2, TL, true, 5>(a, g, stream, tab);
        default:
          return launch_row<OP, T, 2, TL, true, 0>(a, g, stream, tab);
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
// most 128 of its threads an SM (256 rows of 256 or 512 of 128 on an H200), unless
// NORMSPEC_ROW_QUAD=0. On the H200 (CUPTI kernel durations, two passes, equal bits;
// bench/results/probes/row_quad_rows_6bb6202_H200.txt, notes/perf.md §49), warm / after
// the 256 MiB flush, us: 64 x 256 1.22 -> 1.18 / 1.39 -> 1.28, 256 x 256 1.28 -> 1.22 /
// 1.41 -> 1.34, 64 x 128 1.22 -> 1.09 / 1.38 -> 1.18, 512 x 128 1.30 -> 1.18 / 1.41 ->
// 1.28; past the bound it lost (512 x 256 1.31 -> 1.42, 1024 x 128 1.31 -> 1.38, 4096 x
// 256 2.02 -> 2.22).
inline bool row_quad_enabled() {
  static const bool on = !switched_off("NORMSPEC_ROW_QUAD");
  return on;
}
// log2 of the quad form's lanes a row for this launch, 0 where it does not apply
template <int OP, typename T>
int quad_lanes_log(const LaunchArgs& a, const PipeGeometry& g) {
  if (sizeof(T) != 2 || OP == OP_GATED || !row_quad_enabled() || !full_row_forms_enabled() ||
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
    if (full_row_forms_enabled() && row_index_fits_32(a.rows) &&
        fills_team<T, NP>(a.H, g.team_log) &&
        with_team_log<1, 8>(g.team_log, [&](auto tl) {
          launch_row<OP, T, NP, decltype(tl)::value>(a, g, stream);
        }))
      return;
  }
  // The small-row geometry (one vector per thread, teams of 16..256 lanes) of
  // power-of-two rows (128..2048 bf16, 64..1024 fp32 elements): these launches are
  // bound by one row's latency, which the constant forms shorten (bf16 rms: 312 SASS
  // instructions against 696 for the general form).
  if constexpr (NP == 1) {
    if (launch_quad<OP, T>(a, g, stream)) return;
    if (full_row_forms_enabled() && row_index_fits_32(a.rows) &&
        fills_team<T, 1>(a.H, g.team_log) &&
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
  static int occ[9][MAX_FORCED_GLOG + 1][2] = {{{0}}};
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

// NORMSPEC_GATED_BWD_PAIR=0: the gate-table backward's constant forms stay in the
// pipelined kernel (GC) instead of normspec_gated_bwd_pair_kernel, which computes two rows
// a team per iteration (normspec_gated_bwd.cuh says what it leaves out; the same bits),
// where the plan's groups have two rows or more and every offset fits 32 bits
// (offsets_fit_32).
inline bool gated_bwd_pair_enabled() {
  static const bool on = !switched_off("NORMSPEC_GATED_BWD_PAIR");
  return on;
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
  static int occ[MAX_FORCED_GLOG + 1] = {0};
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

// The gate-table backward of the transformers convention with a bf16 weight runs GC 7
// instead of 3, its products u = rt(t * w) and dxhat = rt(rt(du) * w) in packed bf16
// (gated_backward_vec_hf_packed_w, as the forward's GT form 5 does), unless
// NORMSPEC_GATED_BWD_PACKED_W=0. The bench on the H200, alternating processes: hf
// backward 775.4-776.5 us against 778.9-779.8 (device; call 773.6-776.6 against
// 776.4-779.9), the unchanged vllm row moving 3 us across the same runs
// (bench/results/probes/gated_bwd_packed_w_bench_402cc11.txt, notes §28).
inline bool gated_bwd_packed_w_enabled() {
  static const bool on = !switched_off("NORMSPEC_GATED_BWD_PACKED_W");
  return on;
}

// The rms backward of one-row groups (glog = 0) in the constant geometries runs
// normspec_bwd_row_kernel; NORMSPEC_BWD_ROW=0 keeps the pipelined kernel (the same
// bits either way; notes/perf.md §23-24).
inline bool bwd_row_enabled() {
  static const bool on = !switched_off("NORMSPEC_BWD_ROW");
  return on;
}

// The one-row rms backward of 128 threads x 2 passes (H = 256 vectors: 2048 bf16 /
// fp16, 1024 fp32) runs as 256 threads x 1 pass (normspec_bwd_row_kernel<T, 1, 8>) where
// its blocks fit the device at once (at most 8 per SM: rows <= SMs x 8), unless
// NORMSPEC_BWD_ROW_WIDE=0: half the SASS a warp on the few-row chain (197 to EXIT
// against 368 with the saved rstd; torch.compile's 512-thread kernel executes about 160 a
// warp), for a cross-warp fold of eight partials instead of four. The same device
// functions and tree: the same bits. H200 harness, 3 rounds, equal hashes: 1 x 2048
// 3.74-3.87 -> 3.62-3.68 us, 64 x 2048 6.53-6.59 -> 6.46-6.62, 1000 x 2048 16.2 -> 14.7
// (bench/results/sweeps/bwd_row_wide{,_rows}_*.json, notes/perf.md §41).
// NORMSPEC_BWD_ROW_WIDE=2 (an experiment, off by default) takes the wide form at any row
// count whose plan gives each row its own dweight group (up to about 16 x SMs rows), so
// that a sweep can time it past the bound. Mixed there on the H200 (harness, 3 rounds:
// 1400 x 2048 17.34-17.44 us narrow against 17.47-17.57 wide, 2000 x 2048 22.62-22.78
// against 21.95-22.30; bench/results/sweeps/bwd_row_wide_any_f090410.json, notes §42), so
// the bound stays.
inline bool bwd_row_wide(const LaunchArgs& a) {
  static const bool on = !switched_off("NORMSPEC_BWD_ROW_WIDE");
  static const bool any_rows = env_is("NORMSPEC_BWD_ROW_WIDE", '2');
  return on && (any_rows || a.rows <= 8LL * device_sms());
}

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

// The kernel that reads the given rstd where there is one (saved_rstd), else the
// one that computes it: two instantiations, so that neither carries the other's
// registers (one kernel with a runtime switch took the fused backward from four
// blocks per SM to three, 292 us against 248 when recomputing).
//
// The saved-rstd constant forms of the bf16 gated op with the gate table (the GDN
// norm's 128 and 256 lanes) take the convention as constants (GC), which leaves
// the per-element convention branches out of the hot loop.
template <int OP, typename T, int NP, int FULL_TL>
void launch_bwd_pipe(const LaunchArgs& a, float* ws, const BackwardPlan& plan,
                     cudaStream_t stream) {
  if constexpr (OP == OP_RMS && FULL_TL >= 0) {
    if (plan.glog == 0 && bwd_row_enabled()) {
      if constexpr (NP == 2 && FULL_TL == 7) {
        if (bwd_row_wide(a)) {
          if (saved_rstd(a) != nullptr) return launch_bwd_row<T, 1, 8, true>(a, ws, stream);
          return launch_bwd_row<T, 1, 8, false>(a, ws, stream);
        }
      }
      if (saved_rstd(a) != nullptr) return launch_bwd_row<T, NP, FULL_TL, true>(a, ws, stream);
      return launch_bwd_row<T, NP, FULL_TL, false>(a, ws, stream);
    }
  }
  if constexpr (OP == OP_GATED && IsBf16<T>::value && NP == 1 && FULL_TL >= 0) {
    if (saved_rstd(a) != nullptr && bwd_gate_table<OP, T>(a, plan)) {
      const bool pair = plan.glog >= 1 && gated_bwd_pair_enabled() && offsets_fit_32(a);
      auto launch_gc = [&](auto gc) {
        constexpr int GC = decltype(gc)::value;
        if (pair) return launch_gated_bwd_pair<T, FULL_TL, GC>(a, ws, plan, stream);
        launch_bwd_pipe_as<OP, T, NP, FULL_TL, true, GC>(a, ws, plan, stream);
      };
      if (!(a.flags & F_HF)) return launch_gc(std::integral_constant<int, 0>());
      if (!(a.flags & F_W_IS_INPUT)) return launch_gc(std::integral_constant<int, 1>());
      if (gated_bwd_packed_w_enabled()) return launch_gc(std::integral_constant<int, 7>());
      return launch_gc(std::integral_constant<int, 3>());
    }
  }
  if (saved_rstd(a) != nullptr)
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
    if (full_row_forms_enabled() && fills_team<T, NP>(a.H, plan.team_log) &&
        bwd_offsets_fit_32(a) &&
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
  if (!wants_gate_table(op, bf16, a) &&
      row_geometry(a.H, vec, forward_team_override(), op != OP_RMS, a.rows).np > 0)
    return FWD_ROW;
  if (pipe_geometry(a.H, vec, forward_team_override(), false).np > 0) return FWD_PIPE;
  return FWD_REGISTER;
}

template <int OP, typename T>
void forward_t(const LaunchArgs& a, cudaStream_t stream) {
  if (forward_row_with_global_table<OP, T>(a, stream)) return;
  const ForwardKind kind = forward_kind(OP, IsBf16<T>::value, a, VecOf<T>::value);
  if (kind == FWD_ROW) {
    const PipeGeometry rg =
        row_geometry(a.H, VecOf<T>::value, forward_team_override(), OP != OP_RMS, a.rows);
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
    const PipeGeometry pg = pipe_geometry(a.H, VecOf<T>::value, forward_team_override(), false);
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
