// The launch plan of the normspec CUDA kernels: which kernel (family and template
// arguments), block, dynamic shared memory and grid a call runs, as a pure host function
// of a PlanQuery (op, dtype, shape, the flags that matter, the device's numbers). No CUDA
// runtime call: it compiles with a plain C++ compiler (tests/plan_table.cpp prints it for
// tests/test_launch_plan.py, which holds the CuPy backend's twin, backends/cupy/geometry.py
// and launches.py, to it). Occupancy stays with the launchers, which apply
// persistent_grid() to a persistent plan after their own query.
//
// Families: a team of 2**team_log threads handles a row. The register kernels hold rows of
// at most 4096 vectors in NP passes, longer rows stream; 16-byte aligned rows of at most
// 1024 vectors run the one-row forward, the persistent forward (gate tables) and the
// pipelined backward (normspec_pipe.cuh). Every geometry gives the same bits: the
// reductions follow the spec's tree by index.
#pragma once

#include "normspec_arith.h"

namespace normspec {

enum Dtype : int { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

// The backward's dweight plan: each team reduces groups of 2**glog rows and writes
// `groups` fp32 rows of H to the workspace. pipe = 1: the pipelined kernels with teams of
// 2**team_log threads and np passes; 0: the register / streaming kernels.
struct BackwardPlan {
  int glog = 0;
  long long groups = 0;
  int pipe = 0;
  int team_log = 0;
  int np = 0;
};

// What a plan depends on. The backward's dweight groups (`groups`, from backward_plan_for)
// come from the caller, which sizes the workspace by them.
struct PlanQuery {
  int op = OP_RMS;
  int dtype = DT_F32;
  bool backward = false;
  long long rows = 0, H = 0;
  bool aligned = false;         // F_ALIGNED: every row and the weight allow 16-byte vectors
  bool w_raw = false;           // the weight is read in the input dtype (w_in_dtype)
  bool hf = false;              // F_HF
  bool w_is_input = false;      // F_W_IS_INPUT
  bool saved_rstd = false;      // the backward reads the forward's rstd
  bool global_table = true;     // the global gate table may be had (not while capturing)
  bool offsets_fit_32 = true;   // offsets_fit_32() of the launch's strides
  int sms = 132;                // multiprocessors
  int smem_optin = 232448;      // dynamic + static shared memory a block may opt in to
  BackwardPlan groups;
};

enum KernelFamily : int {
  K_FWD_REGISTER,  // normspec_fwd_kernel<OP, T, np>
  K_FWD_STREAM,    // normspec_fwd_stream_kernel<OP, T>
  K_FWD_ROW,       // normspec_fwd_row_kernel<OP, T, np, full_tl, gt_form != 0, gt_form>
  K_FWD_QUAD,      // normspec_fwd_quad_kernel<OP, T, np> (np: lanes a row, log2)
  K_FWD_PIPE,      // normspec_fwd_pipe_kernel<OP, T, np, full_tl>
  K_BWD_REGISTER,  // normspec_bwd_kernel<OP, T, np>
  K_BWD_STREAM,    // normspec_bwd_stream_kernel<OP, T>
  K_BWD_ROW,       // normspec_bwd_row_kernel<T, np, full_tl, saved>
  K_BWD_PIPE,      // normspec_bwd_pipe_kernel<OP, T, np, full_tl, saved, gc>
  K_BWD_PAIR,      // normspec_gated_bwd_pair_kernel<T, full_tl, gc>
};

struct LaunchPlan {
  int kernel = K_FWD_REGISTER;
  int np = 0;
  int full_tl = -1;      // the constant geometry's team_log; -1: the general form
  int gt_form = 0;       // K_FWD_ROW: the global gate table's form, 0 without it
  int gc = -1;           // the gate-table backward's convention constants, -1: run-time
  bool saved = false;    // the backward reads the forward's rstd
  int block_x = 1, block_y = 1;
  long long smem = 0;    // dynamic shared memory
  int team_log = 0;
  int glog = 0;          // the backward's dweight groups (2**glog rows each)
  long long groups = 0;
  bool table = false;    // the per-block gate table in shared memory (F_GATE_TABLE)
  bool persistent = false;  // grid: persistent_grid() over `units` teams
  long long grid = 1;
  long long units = 0;
};

inline int vec_of(int dtype) { return dtype == DT_F32 ? 4 : 8; }

inline long long grid_for(long long units, long long per_block) {
  long long blocks = (units + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > (1LL << 30)) blocks = 1LL << 30;
  return blocks;
}

inline int log2_exact(long long v) {
  int l = 0;
  while ((1LL << l) < v) ++l;
  return l;
}

// ---- the register kernels -----------------------------------------------------------
struct Geometry {
  int threads;  // per team (a row)
  int np;       // passes held in registers; 0 = streaming kernel
};

inline Geometry geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 1024) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 2048) return {1024, 2};
  if (nvec <= 4096) return {1024, 4};
  return {1024, 0};
}

// The backward keeps more per element (dxhat, the dweight stacks): teams of at most 256.
inline Geometry backward_geometry(long long H, int vec) {
  const long long nvec = (H + vec - 1) / vec;
  if (nvec <= 32) return {32, 1};
  if (nvec <= 256) return {static_cast<int>(next_pow2(nvec)), 1};
  if (nvec <= 512) return {256, 2};
  if (nvec <= 1024) return {256, 4};
  return {1024, 0};
}

// The largest dweight group (log2) a register team holds (MaxGroupLog<NP>).
inline int max_group_log(int np) { return np == 1 ? 5 : (np == 2 ? 3 : (np == 4 ? 1 : 0)); }

// The register kernels' groups: the largest (at most max_group_log) that leave every
// resident team of the device a group.
inline BackwardPlan backward_plan(int dtype, long long rows, long long H, int sm_count) {
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

// ---- the pipelined kernels (normspec_pipe.cuh) -------------------------------------
struct PipeGeometry {
  int team_log = 0;
  int np = 0;  // 0: not eligible
  int block() const { return team_log <= 5 ? 256 : 1 << team_log; }
  long long teams_per_block() const { return block() >> team_log; }
};

// Teams of `threads` threads (at most 256) with the fewest passes (1, 2 or 4) that cover
// H; not eligible (np = 0) where none does.
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

// One pass up to 16 vectors in the forward and 32 in the backward, teams of half the
// vectors (two passes) up to 512, 256 x 4 for 513..1024 vectors.
inline PipeGeometry pipe_geometry(long long H, int vec, bool backward) {
  const long long nvec = (H + vec - 1) / vec;
  const long long one_pass = backward ? 32 : 16;
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

// The one-row forward's constant forms index their row in 32 bits.
inline bool row_index_fits_32(long long rows) { return rows <= 0x7fffffffLL; }

// The one-row forward: four vectors per thread for the rms norm, two for the ops with two
// row tensors; few rows double the team (to one vector per thread at most) while the
// teams' threads stay within half the device's resident threads (SMs x 1024).
inline PipeGeometry row_geometry(long long H, int vec, bool two_inputs, long long rows,
                                 int sms) {
  const long long nvec = (H + vec - 1) / vec;
  const long long per_thread = two_inputs ? 2 : 4;
  long long threads = next_pow2(nvec) / per_thread;
  if (threads > 256) threads = 256;
  if (threads < 1) threads = 1;
  const long long one_vector = next_pow2(nvec) < 256 ? next_pow2(nvec) : 256;
  const long long resident_half = static_cast<long long>(sms) * 1024;
  while (threads < one_vector && rows * threads * 2 <= resident_half) threads *= 2;
  return with_passes(threads, H, vec);
}

// Threads per block of the one-row forward: a team of 64+ lanes is its block (the
// whole-block forms take their row from blockIdx.x); smaller teams share 256-thread
// blocks, or one-warp blocks where the launch runs 8 waves of resident threads.
inline int row_block(const PipeGeometry& g, long long rows, int sms) {
  if (g.team_log > 5) return 1 << g.team_log;
  const long long waves8 = static_cast<long long>(sms) * 2048 * 8;
  if ((rows << g.team_log) >= waves8) return 32;
  return 256;
}

// Room kept for the kernels' static shared memory.
constexpr long long STATIC_SMEM_ROOM = 2048;
inline bool fits_smem(long long dynamic_bytes, int optin) {
  return dynamic_bytes + STATIC_SMEM_ROOM <= optin;
}

// The deepest dweight stacks of the pipelined backward, and their budget a block.
constexpr int MAX_PIPE_GLOG = 5;
constexpr long long PIPE_STACK_BUDGET = 40960;

inline long long pipe_stack_bytes(const PipeGeometry& g, int vec, int glog) {
  return static_cast<long long>(glog) * g.np * vec * 4 * g.block();
}

// The weight factors (NP * VEC floats a lane).
inline long long pipe_weight_bytes(const PipeGeometry& g, int vec) {
  return (static_cast<long long>(g.np) * vec * 4) << g.team_log;
}

inline int pipe_max_glog(const PipeGeometry& g, int vec, int optin) {
  const long long weights = pipe_weight_bytes(g, vec);
  int l = 0;
  while (l < MAX_PIPE_GLOG && pipe_stack_bytes(g, vec, l + 1) <= PIPE_STACK_BUDGET &&
         fits_smem(pipe_stack_bytes(g, vec, l + 1) + weights, optin))
    ++l;
  return l;
}

// The pipelined backward's groups for aligned rows (else backward_plan): the largest
// that leave a group for at least half of the teams that fit on the device, never past
// the spec's padded row count (a group's +0.0 rows past it would turn a -0.0 sum +0.0).
inline BackwardPlan backward_plan_aligned(int dtype, long long rows, long long H,
                                          bool aligned, int sm_count, int optin) {
  const int vec = vec_of(dtype);
  const PipeGeometry g = aligned ? pipe_geometry(H, vec, true) : PipeGeometry{};
  if (g.np == 0) return backward_plan(dtype, rows, H, sm_count);
  BackwardPlan plan;
  plan.pipe = 1;
  plan.team_log = g.team_log;
  plan.np = g.np;
  const int ml = pipe_max_glog(g, vec, optin);
  const long long teams = static_cast<long long>(sm_count) * (2048 / g.block()) *
                          g.teams_per_block();
  const long long prow = next_pow2(rows);
  while (plan.glog < ml && (1LL << (plan.glog + 1)) <= prow) {
    const long long R = 1LL << (plan.glog + 1);
    if (2 * ((rows + R - 1) / R) < teams) break;
    ++plan.glog;
  }
  const long long R = 1LL << plan.glog;
  plan.groups = (rows + R - 1) / R;
  return plan;
}

// ---- gate tables -------------------------------------------------------------------
// bf16 gated launches of at least this many elements read act(z) from a table.
constexpr long long GATE_TABLE_MIN_ELEMENTS = 1LL << 20;
inline bool wants_gate_table(int op, int dtype, long long rows, long long H) {
  return op == OP_GATED && dtype == DT_BF16 && rows * H >= GATE_TABLE_MIN_ELEMENTS;
}

// The global table's form of the one-row forward (GTF): the convention and whether the
// weight is read in the input dtype as constants.
inline int gt_form(bool hf, bool w_is_input, bool w_raw) {
  if (!hf) return w_raw ? 4 : 1;
  if (!w_is_input) return 2;
  return w_raw ? 5 : 3;
}

// The gate-table backward's convention constants (GC).
inline int gated_gc(bool hf, bool w_is_input) {
  if (!hf) return 0;
  return w_is_input ? 7 : 1;
}

// Whether rows of H fill a team of 2**team_log threads exactly with NP vectors each.
inline bool fills_team(long long H, int np, int vec, int team_log) {
  return H == (static_cast<long long>(np) * vec << team_log);
}

// ---- the forward ---------------------------------------------------------------------
enum ForwardKind { FWD_REGISTER, FWD_ROW, FWD_PIPE };
inline ForwardKind forward_kind(const PlanQuery& q) {
  if (!q.aligned) return FWD_REGISTER;
  const int vec = vec_of(q.dtype);
  if (!wants_gate_table(q.op, q.dtype, q.rows, q.H) &&
      row_geometry(q.H, vec, q.op != OP_RMS, q.rows, q.sms).np > 0)
    return FWD_ROW;
  if (pipe_geometry(q.H, vec, false).np > 0) return FWD_PIPE;
  return FWD_REGISTER;
}

inline LaunchPlan row_plan(const PlanQuery& q, const PipeGeometry& g, int full_tl) {
  LaunchPlan p;
  p.kernel = K_FWD_ROW;
  p.np = g.np;
  p.full_tl = full_tl;
  p.team_log = g.team_log;
  p.block_x = row_block(g, q.rows, q.sms);
  p.grid = grid_for(q.rows, p.block_x >> g.team_log);
  return p;
}

// Large bf16 gated forwards whose rows fill a two-pass team of 4..64 lanes read act(z)
// from the gate table in global memory; np = 0 where this does not apply.
inline LaunchPlan global_table_plan(const PlanQuery& q) {
  LaunchPlan none;
  if (q.op != OP_GATED || q.dtype != DT_BF16 || !q.aligned || !q.global_table ||
      !wants_gate_table(q.op, q.dtype, q.rows, q.H) || !row_index_fits_32(q.rows))
    return none;
  const PipeGeometry g = row_geometry(q.H, 8, true, q.rows, q.sms);
  if (g.np != 2 || !fills_team(q.H, 2, 8, g.team_log) || g.team_log < 2 || g.team_log > 6)
    return none;
  LaunchPlan p = row_plan(q, g, g.team_log);
  p.gt_form = gt_form(q.hf, q.w_is_input, q.w_raw);
  return p;
}

// The q/k forward in vectors of four: lanes a row (log2), 0 where it does not apply
// (16-bit rms and fused rows of 256 or 128 whose one-row team is one pass of 32 or 16
// lanes, the weight read as it is, at most SMs x 128 lanes in the launch).
inline int quad_lanes_log(const PlanQuery& q, const PipeGeometry& g) {
  if (q.dtype == DT_F32 || q.op == OP_GATED || !q.w_raw || !q.aligned) return 0;
  const int ll = q.H == 256 && g.team_log == 5 ? 6 : (q.H == 128 && g.team_log == 4 ? 5 : 0);
  if (ll == 0 || (q.rows << ll) > static_cast<long long>(q.sms) * 128) return 0;
  return ll;
}

// The one-row forward: rows that fill the team with the default passes take the constant
// form (teams of 2..256), and so do the one-pass small-row teams of 16..256 lanes.
inline LaunchPlan one_row_plan(const PlanQuery& q) {
  const int vec = vec_of(q.dtype);
  const PipeGeometry g = row_geometry(q.H, vec, q.op != OP_RMS, q.rows, q.sms);
  const int default_np = q.op == OP_RMS ? 4 : 2;
  const bool fits = row_index_fits_32(q.rows) && fills_team(q.H, g.np, vec, g.team_log);
  if (g.np == default_np && fits && g.team_log >= 1 && g.team_log <= 8)
    return row_plan(q, g, g.team_log);
  if (g.np == 1) {
    const int ll = quad_lanes_log(q, g);
    if (ll != 0) {
      LaunchPlan p;
      p.kernel = K_FWD_QUAD;
      p.np = ll;
      p.block_x = 256;
      p.grid = grid_for(q.rows, 256 >> ll);
      return p;
    }
    if (fits && g.team_log >= 4 && g.team_log <= 8) return row_plan(q, g, g.team_log);
  }
  return row_plan(q, g, -1);
}

// The persistent forward, with the per-block gate table where it fits; gate-table rows
// that fill a team of 4..32 lanes in one or two passes take the constant form.
inline LaunchPlan persistent_forward_plan(const PlanQuery& q) {
  const int vec = vec_of(q.dtype);
  const PipeGeometry g = pipe_geometry(q.H, vec, false);
  LaunchPlan p;
  p.kernel = K_FWD_PIPE;
  p.np = g.np;
  p.team_log = g.team_log;
  p.table = wants_gate_table(q.op, q.dtype, q.rows, q.H) &&
            fits_smem(pipe_weight_bytes(g, vec) + GATE_TABLE_SLOTS * 4, q.smem_optin);
  if (p.table && g.np <= 2 && fills_team(q.H, g.np, vec, g.team_log) && g.team_log >= 2 &&
      g.team_log <= 5)
    p.full_tl = g.team_log;
  p.block_x = g.block();
  p.smem = pipe_weight_bytes(g, vec) + (p.table ? GATE_TABLE_SLOTS * 4 : 0);
  p.persistent = true;
  p.units = q.rows;
  return p;
}

inline LaunchPlan register_plan(const PlanQuery& q, const Geometry& g, long long units,
                                int kernel, int stream_kernel) {
  LaunchPlan p;
  if (g.np == 0) {
    p.kernel = stream_kernel;
    p.block_x = 1024;
    p.grid = grid_for(q.rows, 1);
    return p;
  }
  p.kernel = kernel;
  p.np = g.np;
  p.block_x = g.threads;
  p.block_y = g.threads == 32 ? 4 : 1;
  p.grid = grid_for(units, p.block_y);
  return p;
}

inline LaunchPlan forward_launch_plan(const PlanQuery& q) {
  const LaunchPlan gt = global_table_plan(q);
  if (gt.np != 0) return gt;
  const ForwardKind kind = forward_kind(q);
  if (kind == FWD_ROW) return one_row_plan(q);
  if (kind == FWD_PIPE) return persistent_forward_plan(q);
  return register_plan(q, geometry(q.H, vec_of(q.dtype)), q.rows, K_FWD_REGISTER,
                       K_FWD_STREAM);
}

// ---- the backward --------------------------------------------------------------------
// Whether the pipelined backward of `b` reads act(z), act'(z) from its gate table.
inline bool backward_gate_table(const PlanQuery& q, const BackwardPlan& b) {
  PipeGeometry g;
  g.team_log = b.team_log;
  g.np = b.np;
  const int vec = vec_of(q.dtype);
  return wants_gate_table(q.op, q.dtype, q.rows, q.H) &&
         fits_smem(pipe_stack_bytes(g, vec, b.glog) + pipe_weight_bytes(g, vec) +
                       GATE_TABLE_SLOTS * 8,
                   q.smem_optin);
}

// The pipelined family: full rows of the common geometries (one pass of 16 or 32 lanes,
// two of 128 or 256 threads) take the constant forms. The rms norm's one-row groups run
// normspec_bwd_row_kernel (128 x 2 as 256 x 1 up to 8 x SMs rows); the bf16 gated
// backward with the table and the saved rstd takes the convention as constants, in
// normspec_gated_bwd_pair_kernel where groups have two rows or more and offsets fit 32 bits.
inline LaunchPlan pipelined_backward_plan(const PlanQuery& q) {
  const BackwardPlan& b = q.groups;
  const int vec = vec_of(q.dtype);
  const int lo = b.np == 1 ? 4 : 7;
  const int full_tl = b.np <= 2 && fills_team(q.H, b.np, vec, b.team_log) &&
                              (b.team_log == lo || b.team_log == lo + 1)
                          ? b.team_log
                          : -1;
  LaunchPlan p;
  p.np = b.np;
  p.full_tl = full_tl;
  p.team_log = b.team_log;
  p.glog = b.glog;
  p.groups = b.groups;
  p.saved = q.saved_rstd;
  PipeGeometry g;
  g.team_log = b.team_log;
  g.np = b.np;
  if (q.op == OP_RMS && full_tl >= 0 && b.glog == 0) {
    p.kernel = K_BWD_ROW;
    if (b.np == 2 && full_tl == 7 && q.rows <= 8LL * q.sms) {
      p.np = 1;
      p.full_tl = 8;
      p.team_log = 8;
      g.team_log = 8;
      g.np = 1;
    }
    p.block_x = g.block();
    p.grid = grid_for(q.rows, g.teams_per_block());
    return p;
  }
  p.kernel = K_BWD_PIPE;
  p.block_x = g.block();
  p.persistent = true;
  p.units = b.groups;
  p.table = backward_gate_table(q, b);
  const long long base = pipe_stack_bytes(g, vec, b.glog) + pipe_weight_bytes(g, vec);
  p.smem = base + (p.table ? GATE_TABLE_SLOTS * 8 : 0);
  if (q.op == OP_GATED && q.dtype == DT_BF16 && b.np == 1 && full_tl >= 0 && q.saved_rstd &&
      p.table) {
    p.gc = gated_gc(q.hf, q.w_is_input);
    if (b.glog >= 1 && q.offsets_fit_32) {
      p.kernel = K_BWD_PAIR;
      p.smem = static_cast<long long>(b.glog - 1) * vec * 4 * 256 + GATE_TABLE_SLOTS * 8;
    }
  }
  return p;
}

inline LaunchPlan backward_launch_plan(const PlanQuery& q) {
  if (q.groups.pipe) return pipelined_backward_plan(q);
  LaunchPlan p = register_plan(q, backward_geometry(q.H, vec_of(q.dtype)), q.groups.groups,
                               K_BWD_REGISTER, K_BWD_STREAM);
  p.glog = q.groups.glog;
  p.groups = q.groups.groups;
  return p;
}

inline LaunchPlan launch_plan(const PlanQuery& q) {
  return q.backward ? backward_launch_plan(q) : forward_launch_plan(q);
}

// The grid of a persistent plan: a team for every unit, at most the resident blocks
// (`per_sm` a multiprocessor, the launcher's occupancy query).
inline long long persistent_grid(const LaunchPlan& p, int per_sm, int sms) {
  const long long per_block = p.block_x >> p.team_log;
  const long long need = (p.units + per_block - 1) / per_block;
  const long long cap = static_cast<long long>(per_sm) * sms;
  return grid_for(need < cap ? need : cap, 1);
}

}  // namespace normspec
