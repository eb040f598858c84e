// normspec pipelined CUDA kernels: the fast path for 16-byte aligned rows.
//
// Same arithmetic and the same reduction trees as normspec_kernels.cuh (every
// partial sum is the tree of an aligned power-of-two segment of the padded
// row, see there), so the bits are those of the spec; what changes is how the
// memory system is kept busy:
//
//   * persistent teams: a team keeps its columns for the whole launch, so
//     the weight is read (and offset) once per block into shared memory, not
//     once per row (and costs no registers);
//   * large bf16 gated launches read act(z) (and act'(z)) from a per-block
//     table that the declared functions fill (see fill_act_table);
//   * software pipelining: the raw 16-byte vectors of the team's *next* row
//     (every row tensor: x, residual or gate, dy, dresidual) are loaded
//     before the current row is reduced, and nothing reads them until the
//     next iteration, so every thread keeps all its loads in flight while
//     the current row's shuffles, barriers, divisions and stores run;
//   * rows stay in registers as raw bf16/fp16/fp32 bits (half the registers
//     of fp32 for 16-bit types) and are widened when used;
//   * teams of 1..32 lanes share a warp (H <= 32 vectors: the gated norm at
//     H = 128 uses 16 lanes per row, not a half-idle warp);
//   * the backward's per-column dweight stacks live in shared memory, not
//     registers (the register kernels need 145-239 registers for them).
//
// Geometry: team = 2**team_log threads (1..256) per row; a block has 256
// threads (8 warps of 32 / team teams each) for teams of at most 32 lanes, and
// is one team otherwise. Loops are uniform per warp (teams <= 32 lanes) or per
// block (larger teams), so the full-mask shuffles and __syncthreads never
// diverge; a team without a row in an iteration joins the shuffles with
// whatever it holds and stores nothing.
//
// Requirements checked by the launcher: F_ALIGNED (all row pointers and row
// strides 16-byte aligned, weight 16-byte aligned), NP * team * VEC >= H.
#pragma once

#include "normspec_kernels.cuh"

namespace normspec {

// ---- raw 16-byte vectors --------------------------------------------------------
// 16-bit rows are rounded two values per instruction (cvt.rn.bf16x2.f32 /
// cvt.rn.f16x2.f32) where a kernel rounds a whole vector: the stores, the fused op's
// rounded residual sum (and its gradient), and the transformers convention's roundings in
// the gated kernels. Each half is rounded to nearest as by the one-value cvt, so the bits
// are the same; the pairs halve the conversions, which run at a fraction of the FP32 rate.
template <typename T>
struct RawBits;

template <>
struct RawBits<float> {
  static __device__ __forceinline__ float get(const uint4& u, int j) {
    const unsigned int w = j == 0 ? u.x : (j == 1 ? u.y : (j == 2 ? u.z : u.w));
    return __uint_as_float(w);
  }
  static __device__ __forceinline__ unsigned int put(float v) { return __float_as_uint(v); }
  static __device__ __forceinline__ unsigned int elem(const float* p) {
    return __float_as_uint(*p);
  }
};

template <typename T>
struct RawBits16 {
  static __device__ __forceinline__ float get(const uint4& u, int j) {
    const int k = j >> 1;
    const unsigned int w = k == 0 ? u.x : (k == 1 ? u.y : (k == 2 ? u.z : u.w));
    return DevIO<T>::from_bits((j & 1) ? (w >> 16) : (w & 0xffffu));
  }
  static __device__ __forceinline__ unsigned int put(float v) { return DevIO<T>::to_bits(v); }
  // two values as one word, lo in the low half (round_pairs)
  static __device__ __forceinline__ unsigned int put2(float lo, float hi) {
    return DevIO<T>::to_bits2(lo, hi);
  }
  static __device__ __forceinline__ unsigned int elem(const T* p) {
    return *reinterpret_cast<const unsigned short*>(p);
  }
};

template <>
struct RawBits<__nv_bfloat16> : RawBits16<__nv_bfloat16> {};
template <>
struct RawBits<__half> : RawBits16<__half> {};

// The rows' 16-byte loads carry the L2 evict_last cache policy (createpolicy +
// ld.global.L2::cache_hint), which measured fastest on the forwards and level or faster
// on the backwards against plain loads, the streaming hints and the other policies; before
// sm_80 (no createpolicy) they are plain. The stores are plain (STG.E.128), which also
// leaves a norm's output in L2 for the layer that reads it next.
__device__ __forceinline__ unsigned long long row_l2_policy() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 load_row_vector(const uint4* p) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  uint4 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(row_l2_policy()));
  return v;
#else
  // plain ld.global (LDG.E.128), as triton's loads; a dereference would take the
  // read-only path (LDG.E.128.CONSTANT) instead
  uint4 v;
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#endif
}
__device__ __forceinline__ void store_row_vector(uint4* p, uint4 v) { *p = v; }

// VEC elements of a row from col (zero bits beyond H), as one raw vector.
// Full vectors are one 16-byte load; only the last, partial vector
// of a row falls back to element loads.
template <typename T>
__device__ __forceinline__ uint4 load_raw(const T* __restrict__ row, int col, int H) {
  constexpr int VEC = VecOf<T>::value;
  if (col + VEC <= H) return load_row_vector(reinterpret_cast<const uint4*>(row + col));
  unsigned int w[4] = {0u, 0u, 0u, 0u};
  if (col < H) {
    constexpr int PER = VEC / 4;  // elements per 32-bit word
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (col + j < H) {
        const unsigned int b = RawBits<T>::elem(row + col + j);
        w[j / PER] |= (PER == 1) ? b : (b << (16 * (j % PER)));
      }
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& u, float (&v)[VecOf<T>::value]) {
#pragma unroll
  for (int j = 0; j < VecOf<T>::value; ++j) v[j] = RawBits<T>::get(u, j);
}

// Each of VEC fp32 values (VEC even) rounded to T and widened back (DevIO<T>::rt),
// two values per conversion.
template <typename T, int VEC>
__device__ __forceinline__ void round_pairs(float (&a)[VEC]) {
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const unsigned int w = RawBits<T>::put2(a[j], a[j + 1]);
      a[j] = DevIO<T>::from_bits(w & 0xffffu);
      a[j + 1] = DevIO<T>::from_bits(w >> 16);
    }
  }
}

// Round VEC fp32 values to T and store those below H.
template <typename T>
__device__ __forceinline__ void store_row(T* __restrict__ row, int col, int H,
                                          const float (&v)[VecOf<T>::value]) {
  constexpr int VEC = VecOf<T>::value;
  constexpr int PER = VEC / 4;
  if (col + VEC <= H) {
    unsigned int w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (PER == 2) {
        w[k] = RawBits<T>::put2(v[2 * k], v[2 * k + 1]);
      } else {
        w[k] = RawBits<T>::put(v[k]);
      }
    }
    store_row_vector(reinterpret_cast<uint4*>(row + col), make_uint4(w[0], w[1], w[2], w[3]));
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (col + j < H) {
        if constexpr (sizeof(T) == 4) {
          reinterpret_cast<float*>(row)[col + j] = v[j];
        } else {
          reinterpret_cast<unsigned short*>(row)[col + j] =
              static_cast<unsigned short>(RawBits<T>::put(v[j]));
        }
      }
    }
  }
}

// A dweight stack's node: the left sibling s (four columns, from the stack) added to the
// right one c[0..3], left operand first, as the spec's row tree sums.
__device__ __forceinline__ void add_left_sibling(const float4& s, float* c) {
  c[0] = add(s.x, c[0]);
  c[1] = add(s.y, c[1]);
  c[2] = add(s.z, c[2]);
  c[3] = add(s.w, c[3]);
}

// ---- team geometry and reduction ------------------------------------------------
struct Team {
  int log;         // log2(threads per team)
  int lane;        // thread index in the team
  long long slot;  // the team's index in the grid
  long long lead;  // slot of the first team of this warp (teams <= 32) / of this team
  long long nslots;
};

__device__ __forceinline__ Team make_team(int team_log) {
  Team t;
  t.log = team_log;
  const long long gtid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  t.lane = static_cast<int>(threadIdx.x) & ((1 << team_log) - 1);
  t.slot = gtid >> team_log;
  t.lead = team_log <= 5 ? (gtid >> 5) << (5 - team_log) : t.slot;
  t.nslots = (static_cast<long long>(gridDim.x) * blockDim.x) >> team_log;
  return t;
}

// Every lane of the team ends with, per pass, the tree of the pass's segment
// (or of [0, P) when P is shorter). red: [NP][32] floats of shared memory,
// used by multi-warp teams (one team per block) only.
template <int NP, int VEC>
__device__ __forceinline__ void team_reduce_pipe(float (&part)[NP], int P, int team_log,
                                                 float* red) {
  // Every lane shuffles at every level and keeps the sum only where the level
  // belongs to the tree (a condition the same for all lanes and rows): no
  // divergent branch around the shuffles, no runtime loop.
  const unsigned full = 0xffffffffu;
  const int team = 1 << team_log;
  const int wlim = team < 32 ? team : 32;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const bool take = off < wlim && VEC * off < P;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const float o = __shfl_xor_sync(full, part[p], off);
      if (take) part[p] = add(part[p], o);
    }
  }
  if (team <= 32) {
    // the broadcast also tells the compiler the sum is the same in every lane, which
    // keeps the rsqrt and division slow paths out of divergence handling
#pragma unroll
    for (int p = 0; p < NP; ++p) part[p] = __shfl_sync(full, part[p], 0, wlim);
    return;
  }
  // the team is the block: one partial per warp through shared memory
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = team >> 5;
  if (lane == 0) {
#pragma unroll
    for (int p = 0; p < NP; ++p) red[p * 32 + warp] = part[p];
  }
  __syncthreads();
  // Every lane reads the warps' partials and folds them itself, in the tree that
  // shuffles over the warps' partials would give lane 0 (level off taken where
  // off < nwarps and 32 * VEC * off < P, each sum's operands in the same order), so no
  // shuffle and no broadcast follow the barrier.
  {
    const bool t1 = 1 < nwarps && 32 * VEC * 1 < P;
    const bool t2 = 2 < nwarps && 32 * VEC * 2 < P;  // implies t1
    const bool t4 = 4 < nwarps && 32 * VEC * 4 < P;  // implies t2
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const float* q = red + p * 32;
      float a = t1 ? add(q[0], q[1]) : q[0];
      if (t2) a = add(a, add(q[2], q[3]));
      if (t4) a = add(a, add(add(q[4], q[5]), add(q[6], q[7])));
      part[p] = a;
    }
  }
}

// The fp32 value the norm reads, from raw x (and raw residual when fused).
template <int OP, typename T>
__device__ __forceinline__ void norm_input_raw(const uint4& rx, const uint4& rr, int flags,
                                               float (&v)[VecOf<T>::value]) {
  unpack<T>(rx, v);
  if constexpr (OP == OP_FUSED) {
    float r[VecOf<T>::value];
    unpack<T>(rr, r);
#pragma unroll
    for (int j = 0; j < VecOf<T>::value; ++j) v[j] = add(v[j], r[j]);
    if (flags & F_ROUNDED) round_pairs<T>(v);
  }
}

// Tree of the squares of v over the thread's segment (padding beyond H: +0.0).
// Zero the summands of a partial vector that lie beyond H (the branch is
// taken by the last vector of a row only).
template <int VEC>
__device__ __forceinline__ void zero_beyond(float (&a)[VEC], int col, int H) {
  if (col + VEC > H) {
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      if (col + j >= H) a[j] = 0.0f;
  }
}

template <int VEC>
__device__ __forceinline__ float sum_sq_masked(const float (&v)[VEC], int col, int H, int P) {
  float a[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) a[j] = mul(v[j], v[j]);
  zero_beyond<VEC>(a, col, H);
  return local_tree<VEC>(a, P);
}

// rstd of the row whose values the norm reads (v[p]: pass p) the team holds
// (every lane gets it).
template <int NP, int VEC>
__device__ __forceinline__ float row_rstd_of(const float (&v)[NP][VEC], int tcol, int S, int H,
                                             int P, float eps, int team_log, float* red) {
  float part[NP];
#pragma unroll
  for (int p = 0; p < NP; ++p) part[p] = sum_sq_masked<VEC>(v[p], p * S + tcol, H, P);
  team_reduce_pipe<NP, VEC>(part, P, team_log, red);
  return rstd_from_ss(fold_passes<NP>(part, S, P), H, eps);
}

// rstd of the row whose raw vectors the team holds (every lane gets it): the same
// steps as row_rstd_of, each pass's values formed and dropped in turn (the persistent
// kernels' register budget was measured with this form).
template <int OP, typename T, int NP>
__device__ __forceinline__ float row_rstd(const uint4 (&rx)[NP], const uint4 (&rr)[NP], int flags,
                                          int tcol, int S, int H, int P,
                                          float eps, int team_log, float* red) {
  constexpr int VEC = VecOf<T>::value;
  float part[NP];
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    float v[VEC];
    norm_input_raw<OP, T>(rx[p], rr[p], flags, v);
    part[p] = sum_sq_masked<VEC>(v, p * S + tcol, H, P);
  }
  team_reduce_pipe<NP, VEC>(part, P, team_log, red);
  return rstd_from_ss(fold_passes<NP>(part, S, P), H, eps);
}

// ---- the weight factors in shared memory ----------------------------------------
// Every team of a block covers the same columns, so the block keeps one copy
// of the per-column factors g = fp32(offset) + w (or w) for rms / fused, the
// fp32 weight itself for the gated op: float4 [NP][VEC / 4][team], read with
// one conflict-free 16-byte load per four elements (registers were the limit
// for more passes when every thread kept its factors).
template <int NP, int VEC>
__device__ __forceinline__ int weight_float4s(int team_log) {
  return (NP * VEC / 4) << team_log;
}

// N (4 or 8) weights of the 16-bit input dtype T from column col, widened
// exactly to fp32 (zeros beyond H): one 8- or 16-byte load.
template <typename T, int N>
__device__ __forceinline__ void load_w_input_dtype(const T* __restrict__ w, int col, int H,
                                                   float (&g)[N]) {
  static_assert(sizeof(T) == 2 && (N == 4 || N == 8), "16-bit weights, 4 or 8 per load");
  float v[8];
  if (col + N <= H) {
    uint4 u;
    if constexpr (N == 8) {
      u = *reinterpret_cast<const uint4*>(w + col);
    } else {
      const uint2 h = *reinterpret_cast<const uint2*>(w + col);
      u = make_uint4(h.x, h.y, 0u, 0u);
    }
    unpack<T>(u, v);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      v[j] = col + j < H ? DevIO<T>::from_bits(RawBits<T>::elem(w + col + j)) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) g[j] = v[j];
}

// The N factors from column col of the weight (zeros beyond H, which nothing
// reads): fp32(offset) + w or w for rms / fused, w for the gated op. `w` holds
// fp32 values, or with F_W_RAW (16-bit inputs only) values of the input dtype T,
// which widen exactly: the same factors without an fp32 copy of the weight.
template <int OP, typename T, int N>
__device__ __forceinline__ void weight_factors(const void* __restrict__ w, int col, int H,
                                               float offset, int flags, float (&g)[N]) {
  if constexpr (sizeof(T) == 2) {
    if (flags & F_W_RAW) {
      load_w_input_dtype<T, N>(static_cast<const T*>(w), col, H, g);
    } else {
      load_w<N>(static_cast<const float*>(w), col, H, true, g);
    }
  } else {
    load_w<N>(static_cast<const float*>(w), col, H, true, g);
  }
  if constexpr (OP != OP_GATED) {
#pragma unroll
    for (int j = 0; j < N; ++j) g[j] = scale_weight(g[j], flags & F_OFFSET, offset);
  }
}

template <int OP, typename T, int NP, int VEC>
__device__ __forceinline__ void fill_weight_smem(float4* __restrict__ wsm,
                                                 const void* __restrict__ w, int team_log,
                                                 int H, float offset, int flags) {
  constexpr int Q = VEC / 4;
  const int n = weight_float4s<NP, VEC>(team_log);
  const int S = VEC << team_log;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int lane = i & ((1 << team_log) - 1);
    const int pq = i >> team_log;
    const int col = (pq / Q) * S + lane * VEC + 4 * (pq % Q);
    float g[4];
    weight_factors<OP, T, 4>(w, col, H, offset, flags, g);
    wsm[i] = make_float4(g[0], g[1], g[2], g[3]);
  }
}

// The same for a block of NTHR threads in teams of 2**TL lanes (the constant-geometry
// backward). With a 16-bit weight read as it is (F_W_RAW) each thread issues all its
// loads (a constant count, 8 bytes each, kept as raw bits) before it widens and stores
// any, so the block waits for memory once before its barrier instead of once per float4
// (the rolled loop: four round trips for rows of 2048 in 128-thread blocks, on the
// critical path of a launch of few rows). The same columns, factors and layout; an fp32
// weight keeps the rolled loop (its raw loads would hold twice the registers).
template <int OP, typename T, int NP, int VEC, int TL, int NTHR>
__device__ __forceinline__ void fill_weight_smem_batched(float4* __restrict__ wsm,
                                                         const void* __restrict__ w, int H,
                                                         float offset, int flags) {
  constexpr int Q = VEC / 4;
  constexpr int n = (NP * VEC / 4) << TL;  // weight_float4s<NP, VEC>(TL)
  constexpr int S = VEC << TL;
  constexpr int PER = (n + NTHR - 1) / NTHR;
  if constexpr (sizeof(T) == 2) {
    if (flags & F_W_RAW) {
      uint2 raw[PER];
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int i = static_cast<int>(threadIdx.x) + k * NTHR;
        const int pq = i >> TL;
        // columns of a float4 of factors: 4 whole elements (n * 4 = H)
        if (n % NTHR == 0 || i < n)
          raw[k] = *reinterpret_cast<const uint2*>(
              static_cast<const T*>(w) + (pq / Q) * S + (i & ((1 << TL) - 1)) * VEC + 4 * (pq % Q));
      }
#pragma unroll
      for (int k = 0; k < PER; ++k) {
        const int i = static_cast<int>(threadIdx.x) + k * NTHR;
        if (n % NTHR == 0 || i < n) {
          const uint4 u = make_uint4(raw[k].x, raw[k].y, 0u, 0u);
          float g[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            g[j] = RawBits<T>::get(u, j);
            if constexpr (OP != OP_GATED) g[j] = scale_weight(g[j], flags & F_OFFSET, offset);
          }
          wsm[i] = make_float4(g[0], g[1], g[2], g[3]);
        }
      }
      return;
    }
  }
  fill_weight_smem<OP, T, NP, VEC>(wsm, w, TL, H, offset, flags);
}


// The VEC factors of pass p for this lane.
template <int VEC>
__device__ __forceinline__ void weight_of(const float4* __restrict__ wsm, int p, int lane,
                                          int team_log, float (&g)[VEC]) {
  constexpr int Q = VEC / 4;
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const float4 v = wsm[((p * Q + q) << team_log) + lane];
    g[4 * q] = v.x;
    g[4 * q + 1] = v.y;
    g[4 * q + 2] = v.z;
    g[4 * q + 3] = v.w;
  }
}

// ---- the gate's activation table (bf16 gates) -------------------------------------
// A bf16 gate has 2**16 values, so act(z) (and act'(z) in the backward) is a
// function of 16 bits. Large gated launches evaluate it once per block, with
// the very same act_fp32 / act_and_grad_fp32, for the gates whose magnitude
// lies in [2**-24, 2**8) (32 binades of 128 values, both signs: 8192 slots),
// and evaluate the rest (zeros, tiny and huge values, inf, NaN) directly.
// The table only saves re-evaluating the declared functions; the bits are
// theirs by construction. GATE_TABLE_SLOTS: normspec_arith.h.
constexpr int GATE_TABLE_E0 = 127 - 24;  // the lowest biased exponent in the table

template <typename T>
struct IsBf16 {
  static constexpr bool value = false;
};
template <>
struct IsBf16<__nv_bfloat16> {
  static constexpr bool value = true;
};

// The table slot of a bf16 gate held as fp32 (its low 16 bits are zero),
// always a valid index; `miss` tells whether the gate lies outside the table.
__device__ __forceinline__ int gate_slot(float z, bool& miss) {
  const unsigned int u = __float_as_uint(z) >> 16;
  const unsigned int t = (u & 0x7fffu) - (GATE_TABLE_E0 << 7);
  miss = t >= 4096u;
  return static_cast<int>((t & 0xfffu) | ((u >> 3) & 0x1000u));
}

// The gate of slot k (the inverse of gate_slot).
__device__ __forceinline__ float slot_gate(int k) {
  const unsigned int u = ((static_cast<unsigned int>(k) & 0x1000u) << 3) |
                         ((static_cast<unsigned int>(k) & 0xfffu) + (GATE_TABLE_E0 << 7));
  return __uint_as_float(u << 16);
}

__device__ __forceinline__ void fill_act_table(float* __restrict__ tab, bool sig) {
  for (int k = threadIdx.x; k < GATE_TABLE_SLOTS; k += blockDim.x)
    tab[k] = act_fp32(slot_gate(k), sig);
}

__device__ __forceinline__ void fill_act_grad_table(float2* __restrict__ tab, bool sig) {
  for (int k = threadIdx.x; k < GATE_TABLE_SLOTS; k += blockDim.x) {
    const Act a = act_and_grad_fp32(slot_gate(k), sig);
    tab[k] = make_float2(a.a, a.da);
  }
}

// The declared function out of line, for the rare gates outside the table: the
// forward's hot loop is short then (ncu: instruction-fetch stalls when inlined).
static __device__ __noinline__ float act_cold(float z, bool sig) { return act_fp32(z, sig); }

// The table entries of VEC gates: straight-line reads (`read` of each slot), then
// one rarely taken branch that evaluates the gates outside the table (`cold`).
template <int VEC, typename E, typename Read, typename Cold>
__device__ __forceinline__ void lookup_gates(const float (&z)[VEC], E (&out)[VEC], Read read,
                                             Cold cold) {
  bool any = false;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    bool miss;
    out[j] = read(gate_slot(z[j], miss));
    any |= miss;
  }
  if (any) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      bool miss;
      gate_slot(z[j], miss);
      if (miss) out[j] = cold(z[j]);
    }
  }
}

// act(z) of VEC gates from the table.
template <int VEC>
__device__ __forceinline__ void acts_from_table(const float* __restrict__ tab,
                                                const float (&z)[VEC], bool sig,
                                                float (&act)[VEC]) {
  lookup_gates<VEC>(z, act, [&](int k) { return tab[k]; },
                    [&](float g) { return act_cold(g, sig); });
}

// act(z) and act'(z) of one gate: the table, or the declared function for the
// gates outside it. Per element and inline: the forward's batched form with an
// out-of-line slow path costs the backward registers (98-121 instead of 80).
__device__ __forceinline__ Act act_grad_from_table(const float2* __restrict__ tab, float z,
                                                   bool sig) {
  bool miss;
  const int k = gate_slot(z, miss);
  if (miss) return act_and_grad_fp32(z, sig);
  const float2 v = tab[k];
  Act a;
  a.a = v.x;
  a.da = v.y;
  return a;
}

// The declared function out of line, for the rare gates outside the table.
static __device__ __noinline__ Act act_grad_cold(float z, bool sig) {
  return act_and_grad_fp32(z, sig);
}

// act(z) and act'(z) of VEC gates from the table, the gates outside it out of line,
// as acts_from_table does for the forward. One branch per vector instead of one per
// element; the kernels that use it have registers to spare (their shared memory,
// not their registers, bounds the resident blocks).
template <int VEC>
__device__ __forceinline__ void act_grads_from_table(const float2* __restrict__ tab,
                                                     const float (&z)[VEC], bool sig,
                                                     Act (&act)[VEC]) {
  lookup_gates<VEC>(
      z, act,
      [&](int k) {
        const float2 v = tab[k];
        Act a;
        a.a = v.x;
        a.da = v.y;
        return a;
      },
      [&](float g) { return act_grad_cold(g, sig); });
}

// gated_backward_act of VEC elements (xh: xhat, w: the weight factors, a: act(z) and
// act'(z)): dgate, dxhat and the dweight contributions, with the transformers
// convention's roundings taken two values per conversion (round_pairs).
template <typename T, int VEC>
__device__ __forceinline__ void gated_backward_vec(const float (&xh)[VEC], const float (&w)[VEC],
                                                   const Act (&a)[VEC], const float (&dy)[VEC],
                                                   bool hf, bool w_in, float (&dg)[VEC],
                                                   float (&dxh)[VEC], float (&contrib)[VEC]) {
  float t[VEC], u[VEC], du[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) t[k] = xh[k];
  if (hf) round_pairs<T>(t);  // the xhat that meets the weight (xhat itself when vllm)
#pragma unroll
  for (int k = 0; k < VEC; ++k) u[k] = mul(t[k], w[k]);
  if (hf && w_in) round_pairs<T>(u);  // gated_weighted
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    dg[k] = mul(mul(dy[k], u[k]), a[k].da);
    du[k] = mul(dy[k], a[k].a);
  }
  if (hf && w_in) round_pairs<T>(du);
#pragma unroll
  for (int k = 0; k < VEC; ++k) dxh[k] = mul(du[k], w[k]);
  if (hf) round_pairs<T>(dxh);
#pragma unroll
  for (int k = 0; k < VEC; ++k) contrib[k] = mul(du[k], t[k]);
}

// One output vector from v, the values the norm reads (norm_input_raw of the raw x
// and residual / gate vectors), the raw gate vector rr (the gated op), rstd and the
// VEC weight factors g: y, and for the fused op the new residual. The gated op
// reads act(z) from the gate table when `table` is set.
template <int OP, typename T>
__device__ __forceinline__ void forward_of(const float (&v)[VecOf<T>::value], const uint4& rr,
                                           int flags, float rstd,
                                           const float (&g)[VecOf<T>::value], bool table,
                                           const float* __restrict__ tab, T* __restrict__ yrow,
                                           T* __restrict__ y2row, int col, int H) {
  constexpr int VEC = VecOf<T>::value;
  float out[VEC];
  if constexpr (OP == OP_GATED) {
    const bool hf = flags & F_HF, sig = flags & F_SIGMOID, w_in = flags & F_W_IS_INPUT;
    float z[VEC], act[VEC];
    unpack<T>(rr, z);
    if (table) {
      acts_from_table<VEC>(tab, z, sig, act);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) act[j] = act_fp32(z[j], sig);
    }
    // gated_forward_act per element, with the transformers convention's roundings
    // (DevIO<T>::rt in gated_weighted) taken two values at a time
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = mul(v[j], rstd);
    if (hf) round_pairs<T>(out);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = mul(out[j], g[j]);
    if (hf && w_in) round_pairs<T>(out);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = mul(out[j], act[j]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = mul(mul(v[j], rstd), g[j]);
  }
  store_row<T>(yrow, col, H, out);
  if constexpr (OP == OP_FUSED) store_row<T>(y2row, col, H, v);
}

// The same from the raw vectors.
template <int OP, typename T>
__device__ __forceinline__ void forward_vector(const uint4& rx, const uint4& rr, int flags,
                                               float rstd, const float (&g)[VecOf<T>::value],
                                               bool table, const float* __restrict__ tab,
                                               T* __restrict__ yrow, T* __restrict__ y2row,
                                               int col, int H) {
  float v[VecOf<T>::value];
  norm_input_raw<OP, T>(rx, rr, flags, v);
  forward_of<OP, T>(v, rr, flags, rstd, g, table, tab, yrow, y2row, col, H);
}

// Two bf16 products, each the exact product rounded once to nearest even, as one packed
// word (lo in the low half): mul.rn.bf16x2 (sm_90), or on sm_80 / 89 fma.rn.bf16x2 with a
// -0 addend, which keeps the product's sign of zero (ptxas emits HMUL2.BF16_V2 for both);
// before sm_80, the fp32 product rounded (the spec's path). For bf16 a and w this is the
// spec's rt(fp32(a * w)): the 8-bit significands make a product of 16 bits at most, exact
// in fp32 wherever it is at least 2**-134 (its last bit then at least 2**-149), and below
// 2**-134 both round to a zero of the product's sign (an fp32 rounding cannot lift it past
// that midpoint: it would need a significand product above 2**16). Overflow is inf either
// way; NaN stays NaN (its payload is unspecified, spec/arithmetic.py).
template <typename T>
__device__ __forceinline__ unsigned int mul_rn_bf16x2(unsigned int a, unsigned int w) {
  static_assert(IsBf16<T>::value, "packed bf16 products");
  unsigned int d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(w));
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(w), "r"(0x80008000u));
#else
  // no bf16 arithmetic before sm_80: the spec's own path, the same bits
  d = RawBits<T>::put2(mul(DevIO<T>::from_bits(a & 0xffffu), DevIO<T>::from_bits(w & 0xffffu)),
                       mul(DevIO<T>::from_bits(a >> 16), DevIO<T>::from_bits(w >> 16)));
#endif
  return d;
}

// The transformers convention's gated output for a bf16 weight read as it is (wr, the
// raw vector of VEC weights): rt(rt(v * rstd) * w) * act(z), rounded at the store, with
// the middle product taken two at a time in bf16 (mul_rn_bf16x2) instead of widening
// the weight, multiplying in fp32 and rounding again: the same bits in about three fewer
// instructions per element (GT form 5).
template <typename T>
__device__ __forceinline__ void forward_gated_hf_packed_w(const float (&v)[VecOf<T>::value],
                                                          const uint4& rr, bool sig, float rstd,
                                                          const uint4& wr,
                                                          const float* __restrict__ tab,
                                                          T* __restrict__ yrow, int col, int H) {
  constexpr int VEC = VecOf<T>::value;
  static_assert(VEC == 8, "bf16 vectors of eight");
  // the products first, so that v is dead (four words instead of eight values) before
  // the gates' lookups: with the lookups first, ptxas spilled 32 bytes at 64 registers
  const unsigned int wv[4] = {wr.x, wr.y, wr.z, wr.w};
  unsigned int pw[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned int xh = RawBits<T>::put2(mul(v[2 * k], rstd), mul(v[2 * k + 1], rstd));
    pw[k] = mul_rn_bf16x2<T>(xh, wv[k]);
  }
  float z[VEC], act[VEC], out[VEC];
  unpack<T>(rr, z);
  acts_from_table<VEC>(tab, z, sig, act);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = mul(DevIO<T>::from_bits(pw[k] & 0xffffu), act[2 * k]);
    out[2 * k + 1] = mul(DevIO<T>::from_bits(pw[k] >> 16), act[2 * k + 1]);
  }
  store_row<T>(yrow, col, H, out);
}

// gated_backward_vec of the transformers convention for a bf16 weight (hf and w_in),
// with both of its weight products taken two at a time in bf16 (mul_rn_bf16x2):
// u = rt(t * w) for dgate and dxhat = rt(rt(du) * w), instead of widening, multiplying
// in fp32 and rounding again. The weight factors w are bf16 values (the weight in the
// input dtype, no offset), so packing them is exact; each product is then the exact
// product rounded once, the spec's bits (forward_gated_hf_packed_w says why). The
// backward's GC 7: about 1.5 fewer instructions per element than GC 3.
template <typename T, int VEC>
__device__ __forceinline__ void gated_backward_vec_hf_packed_w(
    const float (&xh)[VEC], const float (&w)[VEC], const Act (&a)[VEC], const float (&dy)[VEC],
    float (&dg)[VEC], float (&dxh)[VEC], float (&contrib)[VEC]) {
  static_assert(VEC % 2 == 0, "pairs");
#pragma unroll
  for (int k = 0; k < VEC; k += 2) {
    const unsigned int tp = RawBits<T>::put2(xh[k], xh[k + 1]);  // t = rt(xhat)
    const unsigned int wp = RawBits<T>::put2(w[k], w[k + 1]);    // exact
    const unsigned int up = mul_rn_bf16x2<T>(tp, wp);            // u = rt(t * w)
    dg[k] = mul(mul(dy[k], DevIO<T>::from_bits(up & 0xffffu)), a[k].da);
    dg[k + 1] = mul(mul(dy[k + 1], DevIO<T>::from_bits(up >> 16)), a[k + 1].da);
    const unsigned int dup = RawBits<T>::put2(mul(dy[k], a[k].a), mul(dy[k + 1], a[k + 1].a));
    const unsigned int dxp = mul_rn_bf16x2<T>(dup, wp);  // dxhat = rt(rt(du) * w)
    dxh[k] = DevIO<T>::from_bits(dxp & 0xffffu);
    dxh[k + 1] = DevIO<T>::from_bits(dxp >> 16);
    contrib[k] = mul(DevIO<T>::from_bits(dup & 0xffffu), DevIO<T>::from_bits(tp & 0xffffu));
    contrib[k + 1] = mul(DevIO<T>::from_bits(dup >> 16), DevIO<T>::from_bits(tp >> 16));
  }
}

}  // namespace normspec

// The gate table in global memory of the one-row forward's GT form: act(z) of every
// slot (normspec::slot_gate), `sig` choosing the activation, with the declared function.
// (A template, T the gates' dtype, so that each translation unit may hold it.)
template <typename T>
__global__ void normspec_fill_gate_table_kernel(float* __restrict__ tab, int sig) {
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < normspec::GATE_TABLE_SLOTS;
       k += gridDim.x * blockDim.x)
    tab[k] = normspec::act_fp32(normspec::slot_gate(k), sig != 0);
}

// ---- forward --------------------------------------------------------------------
//   OP_RMS: r, y2 unused.  OP_FUSED: r = residual, y2 = new residual.
//   OP_GATED: r = gate, y2 unused.
//
// FULL_TL >= 0 (the gated op on bf16 with the gate table only): rows that fill
// the team exactly (H = NP * VEC * 2**FULL_TL) with teams of 2**FULL_TL
// threads, as for the one-row forward; the table is then always used, so the
// kernel holds no inline evaluation of the activation outside the table fill.
template <int OP, typename T, int NP, int FULL_TL = -1>
__global__ void __launch_bounds__(256)
    normspec_fwd_pipe_kernel(const T* __restrict__ x, const T* __restrict__ r,
                             const void* __restrict__ w, T* __restrict__ y,
                             T* __restrict__ y2, long long rows, long long H_arg, long long sx,
                             long long sr, long long sy, long long sy2, float eps, float offset,
                             int flags, int team_log_arg, float* __restrict__ rstd_out = nullptr) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  constexpr bool TWO = OP != OP_RMS;  // a second row tensor (residual / gate)
  constexpr bool TABLE_OK = OP == OP_GATED && IsBf16<T>::value;
  constexpr bool FULL = FULL_TL >= 0;
  static_assert(!FULL || TABLE_OK, "the constant-geometry form is the gate-table kernel");
  __shared__ float red[2][NP * 32];
  extern __shared__ float4 dyn[];  // weight factors, then the gate table
  const int team_log = FULL ? FULL_TL : team_log_arg;
  const long long H = FULL ? (static_cast<long long>(NP) * VEC) << (FULL ? FULL_TL : 0) : H_arg;
  const Team tm = make_team(team_log);
  const int Hc = static_cast<int>(H);  // <= 8192: column arithmetic in 32 bits
  const int P = FULL ? Hc : static_cast<int>(next_pow2(H));
  const int S = VEC << team_log;
  const int tcol = tm.lane * VEC;
  const bool sig = flags & F_SIGMOID;
  const bool table = FULL || (TABLE_OK && (flags & F_GATE_TABLE));

  float4* wsm = dyn;
  float* tab = reinterpret_cast<float*>(dyn + weight_float4s<NP, VEC>(team_log));
  // rows of this team: row0 + (slot - lead), row0 = lead, lead + nslots, ...
  const long long mine = tm.slot - tm.lead;
  uint4 cx[NP], cr[NP], nx[NP], nr[NP];
  {
    const long long row = tm.lead + mine;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      nx[p] = make_uint4(0u, 0u, 0u, 0u);
      nr[p] = nx[p];
      if (row < rows) {
        nx[p] = load_raw<T>(x + row * sx, p * S + tcol, Hc);
        if (TWO) nr[p] = load_raw<T>(r + row * sr, p * S + tcol, Hc);
      }
    }
  }
  // the weight factors and the gate table while the first rows are in flight
  fill_weight_smem<OP, T, NP, VEC>(wsm, w, team_log, Hc, offset, flags);
  if (table) fill_act_table(tab, sig);
  __syncthreads();
  int buf = 0;
  for (long long row0 = tm.lead; row0 < rows; row0 += tm.nslots) {
    const long long row = row0 + mine;
    const long long nrow = row + tm.nslots;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      cx[p] = nx[p];
      cr[p] = nr[p];
      if (nrow < rows) {  // prefetch: not read before the next iteration
        nx[p] = load_raw<T>(x + nrow * sx, p * S + tcol, Hc);
        if (TWO) nr[p] = load_raw<T>(r + nrow * sr, p * S + tcol, Hc);
      }
    }
    const float rstd =
        row_rstd<OP, T, NP>(cx, cr, flags, tcol, S, Hc, P, eps, team_log, red[buf]);
    buf ^= 1;
    if (row < rows) {
      if (rstd_out != nullptr && tm.lane == 0) rstd_out[row] = rstd;
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = p * S + tcol;
        if (col < Hc) {
          float g[VEC];
          weight_of<VEC>(wsm, p, tm.lane, team_log, g);
          forward_vector<OP, T>(cx[p], cr[p], flags, rstd, g, table, tab, y + row * sy,
                                OP == OP_FUSED ? y2 + row * sy2 : nullptr, col, Hc);
        }
      }
    }
  }
}

// How the one-row forward addresses its passes: from the lane's own pointers (p * S past
// them), or from the row's start (p * S + tcol past it). Either way a pass reads and
// writes the same elements with the same bounds; only the SASS differs. The row's start
// measured faster for the rms norm's constant forms of 64 and more lanes with more than
// one pass, the lane's pointers for the other forms.
__host__ __device__ constexpr bool row_per_pass_addressing(int op, int np, int full_tl) {
  return op == normspec::OP_RMS && np > 1 && full_tl >= 6;
}

// ---- forward, one row per team ------------------------------------------------
// The default forward wherever the gate table is not used: a team loads its
// row, reduces it, writes it and is done; the block scheduler streams the
// rows, so as many rows are in flight as registers allow, and the weight
// factors come from global memory (L1 hits) instead of a per-block fill: a few per
// cent faster than the persistent kernel. Same device functions as the persistent kernel, so the same bits.
//
// FULL_TL >= 0: rows that fill the team exactly (H = NP * VEC * 2**FULL_TL, so
// every vector is full and P = H) with teams of 2**FULL_TL threads: the team
// size and H are constants, so every geometry predicate of the shared device
// functions (shuffle and tree levels, tails, col < H) folds away; the launcher
// picks this form for power-of-two rows in the default geometry. FULL_TL = -1:
// any H and team (the `H` and `team_log` arguments).
//
// GT (large bf16 gated forwards): act(z) from `gtab`, a gate table in global memory that
// the launcher fills once per device (normspec_fill_gate_table_kernel), instead of
// evaluating it per element. The persistent kernel's table lives in shared memory and is
// filled by every block, which is what makes that kernel persistent; a global table lets
// the gated forward run one row per team like the other ops (the bits are the declared
// functions' either way).
//
// The register budget, as the __launch_bounds__ minimum of resident 256-thread blocks
// per SM (row_min_blocks): 4 (64 registers) for the GT forms and for the rms norm's
// constant forms of teams of 64 and more lanes, which without the cap took 80 registers
// and too few warps to hide DRAM latency; 1 for the other forms, which ran as fast or
// faster uncapped.
__host__ __device__ constexpr int row_min_blocks(int op, int full_tl, bool gt) {
  return gt ? 4 : (op == normspec::OP_RMS && full_tl >= 6) ? 4 : 1;
}
// The GT forms (GTF, with GT): 1 the vllm convention's own (GT_VLLM below), 2 / 3 the
// transformers convention's own, with its roundings as constants: F_HF set and
// F_W_IS_INPUT clear (an fp32 weight) / set (a weight of the input dtype); 4: 1 with
// F_W_RAW set as a constant (the launcher takes it only for a weight it passes in the
// input dtype), so that the fp32 weight's load path drops out; 5: 3 with F_W_RAW a
// constant and the weight's product in packed bf16 (forward_gated_hf_packed_w). 0 (no
// GT): the flags decide at run time.
// GT_VLLM (forms 1 and 4): the vllm convention's form keeps the raw x and unpacks it
// again after the reduction instead of keeping the unpacked values: no spill at 64
// registers. It still reads F_HF at run time: with the flag known clear, ptxas spilled.
template <int OP, typename T, int NP, int FULL_TL = -1, bool GT = false, int GTF = 0>
__global__ void __launch_bounds__(256, row_min_blocks(OP, FULL_TL, GT))
    normspec_fwd_row_kernel(const T* __restrict__ x, const T* __restrict__ r,
                            const void* __restrict__ w, T* __restrict__ y,
                            T* __restrict__ y2, long long rows, long long H, long long sx,
                            long long sr, long long sy, long long sy2, float eps, float offset,
                            int flags, int team_log_arg, float* __restrict__ rstd_out = nullptr,
                            const float* __restrict__ gtab = nullptr) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  constexpr bool TWO = OP != OP_RMS;
  constexpr bool FULL = FULL_TL >= 0;
  static_assert(!GT || (OP == OP_GATED && IsBf16<T>::value),
                "the global gate table holds bf16 gates");
  __shared__ float red[NP * 32];
  const int team_log = FULL ? FULL_TL : team_log_arg;
  const Team tm = make_team(team_log);
  // The constant forms' teams of 64 and more lanes are whole blocks, one per row
  // (launch_row: row_block gives them blocks of their size, grid_for one block a row), so
  // the row is blockIdx.x and every team has one, as in the one-row backward
  // (normspec_bwd_row_kernel's PER_BLOCK): fewer instructions before the first load
  constexpr bool PER_BLOCK = FULL && FULL_TL >= 6;
  // The constant forms' teams of at most a warp (several a block) take their row as
  // the block's first team plus the thread's team, in 32 bits (launch_row: fewer than 2^31
  // rows, row_index_fits_32), instead of the 64-bit slot of the grid-wide thread index
  constexpr bool SLOT32 = FULL && FULL_TL <= 5;
  constexpr int SLOT_SHIFT = FULL ? FULL_TL : 0;
  const long long row =
      PER_BLOCK ? static_cast<long long>(blockIdx.x)
      : SLOT32  ? static_cast<long long>(blockIdx.x * (blockDim.x >> SLOT_SHIFT) +
                                        (threadIdx.x >> SLOT_SHIFT))
                : tm.slot;
  const bool live = PER_BLOCK || row < rows;
  // <= 8192: column arithmetic in 32 bits
  const int Hc = FULL ? (NP * VEC) << (FULL ? FULL_TL : 0) : static_cast<int>(H);
  const int P = FULL ? Hc : static_cast<int>(next_pow2(H));
  const int S = VEC << team_log;
  const int tcol = tm.lane * VEC;
  // The lane's own pointers, formed once, so that every pass's vector is an offset
  // p * S from them (a constant in the constant-geometry forms): column p * S against
  // H - tcol reads and writes the same elements, with the same bounds, as column
  // p * S + tcol against H. The constant forms' vectors are all full, which the bound
  // Hc (a constant) lets the compiler see.
  const int Hl = FULL ? Hc : Hc - tcol;
  // which addressing this form takes (row_per_pass_addressing)
  constexpr bool PER_PASS = row_per_pass_addressing(OP, NP, FULL_TL);
  uint4 cx[NP], cr[NP];
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    cx[p] = make_uint4(0u, 0u, 0u, 0u);
    cr[p] = cx[p];
    if (live) {
      if constexpr (PER_PASS) {
        cx[p] = load_raw<T>(x + row * sx, p * S + tcol, Hc);
        if (TWO) cr[p] = load_raw<T>(r + row * sr, p * S + tcol, Hc);
      } else {
        cx[p] = load_raw<T>(x + row * sx + tcol, p * S, Hl);
        if (TWO) cr[p] = load_raw<T>(r + row * sr + tcol, p * S, Hl);
      }
    }
  }
  // With more passes, the rms and fused forms of a 16-bit weight read as it is (F_W_RAW)
  // issue the weight's loads with the row's, as raw vectors (4 registers a pass), instead
  // of after the reduction: warm, the row's loads return soon, and the weight's round trip
  // after the reduction is then on the critical path (Liger's kernel loads both at once).
  // The factors are widened and scaled as weight_factors does, so the bits are the same.
  // The one-pass forms of teams of at most a warp (the q/k rows of 256 and narrower) keep
  // the 16-bit weight raw from its load too, and widen and scale it for the output, after
  // the reduction, instead of before the reduction starts (g1 below), which would put the
  // unpacking between the loads' return and the first square. The whole-block one-pass
  // forms (rows of 2048) measured slower that way and keep g1.
  constexpr bool EARLY_W =
      (NP > 1 || FULL_TL <= 5) && FULL && sizeof(T) == 2 && OP != OP_GATED;
  uint4 w_raw[EARLY_W ? NP : 1];
  if constexpr (EARLY_W) {
    if (flags & F_W_RAW) {
#pragma unroll
      for (int p = 0; p < NP; ++p)  // every vector is whole (FULL)
        w_raw[p] = *reinterpret_cast<const uint4*>(static_cast<const T*>(w) + p * S + tcol);
    }
  }
  // One pass (the small-row geometry, few rows in flight), where the weight is not kept raw
  // above: its load is issued with the row's, not after the reduction, so that a
  // latency-bound launch waits for memory once. More passes would hold NP * VEC more
  // registers in every thread.
  float g1[NP == 1 ? VEC : 1];
  if constexpr (NP == 1) {
    if (live && tcol < Hc && !(EARLY_W && (flags & F_W_RAW)))
      weight_factors<OP, T, VEC>(w, tcol, Hc, offset, flags, g1);
  }
  // The values the norm reads, formed once for the reduction and the output. For the
  // two-input ops they take the registers of the raw x and residual / gate vectors
  // (the gate's raw vector stays for the activation); the rms norm keeps its raw x
  // (half the registers) and unpacks it again for the output, and so does the GT_VLLM
  // form.
  static_assert(GTF == 0 || GT, "the GT forms are forms of the GT path");
  // form 4: 1 with the weight read in the input dtype (F_W_RAW) as a constant too, so that
  // the fp32 weight's load path drops out; form 5: 3 with the weight read as it is (F_W_RAW
  // a constant) and its product taken in packed bf16 (forward_gated_hf_packed_w)
  constexpr bool GT_VLLM = GTF == 1 || GTF == 4;
  constexpr bool HF_PACKED_W = GTF == 5;
  if constexpr (GTF == 2 || GTF == 3 || GTF == 5)
    flags = (flags & ~F_W_IS_INPUT) | F_HF | (GTF == 2 ? 0 : F_W_IS_INPUT);
  if constexpr (GTF >= 4) flags |= F_W_RAW;
  constexpr bool KEEP = TWO && !GT_VLLM;
  float v[NP][VEC];
#pragma unroll
  for (int p = 0; p < NP; ++p) norm_input_raw<OP, T>(cx[p], cr[p], flags, v[p]);
  // a team past the last row still joins the shuffles (and the barrier)
  const float rstd = row_rstd_of<NP, VEC>(v, tcol, S, Hc, P, eps, team_log, red);
  if (!live) return;
  if (rstd_out != nullptr && tm.lane == 0) rstd_out[row] = rstd;
  if constexpr (GT_VLLM) {
    // the raw x as if new, so that the compiler unpacks it again instead of keeping
    // the values of the reduction alive (it emits no instruction)
#pragma unroll
    for (int p = 0; p < NP; ++p)
      asm volatile("" : "+r"(cx[p].x), "+r"(cx[p].y), "+r"(cx[p].z), "+r"(cx[p].w));
  }
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    const int col = p * S + tcol;
    if (col < Hc) {
      T* yl = y + row * sy + tcol;
      T* y2l = OP == OP_FUSED ? y2 + row * sy2 + tcol : nullptr;
      if constexpr (HF_PACKED_W) {
        static_assert(KEEP && NP > 1 && FULL, "the packed form keeps v, two passes, whole rows");
        // every vector is whole (FULL): one 16-byte load of the weight, kept raw
        const uint4 wr = *reinterpret_cast<const uint4*>(static_cast<const T*>(w) + col);
        forward_gated_hf_packed_w<T>(v[p], cr[p], (flags & F_SIGMOID) != 0, rstd, wr, gtab,
                                     yl, p * S, Hl);
        continue;
      }
      float g[VEC];
      if (EARLY_W && (flags & F_W_RAW)) {
        unpack<T>(w_raw[EARLY_W ? p : 0], g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] = scale_weight(g[j], flags & F_OFFSET, offset);
      } else if constexpr (NP == 1) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) g[j] = g1[j];
      } else {
        weight_factors<OP, T, VEC>(w, col, Hc, offset, flags, g);
      }
      if constexpr (KEEP) {
        forward_of<OP, T>(v[p], cr[p], flags, rstd, g, GT, GT ? gtab : nullptr, yl, y2l, p * S,
                          Hl);
      } else {
        if constexpr (PER_PASS) {
          forward_vector<OP, T>(cx[p], cr[p], flags, rstd, g, GT, GT ? gtab : nullptr,
                                y + row * sy, OP == OP_FUSED ? y2 + row * sy2 : nullptr, col,
                                Hc);
        } else {
          forward_vector<OP, T>(cx[p], cr[p], flags, rstd, g, GT, GT ? gtab : nullptr, yl, y2l,
                                p * S, Hl);
        }
      }
    }
  }
}

// ---- the q/k forward in vectors of four ----------------------------------------------
// The rms and fused forwards of rows of 4 * 2**LL 16-bit elements (256: LL 6, two warps a
// row; 128: LL 5, one warp) with a weight of the input dtype, four elements a lane (8-byte
// loads and stores) instead of the one-pass warp teams' eight, torch.compile's shape for
// few q/k rows. A lane's chain from its loads to its store is about half as long; the
// launch plan takes it for launches of few rows (quad_lanes_log in normspec_plan.h),
// since with more the second warp's instructions cost more than the shorter chain saves.
// The same tree: each lane's four squares in two levels, five shuffle levels a warp, and
// with two warps their sums from shared memory, the left warp's first.
namespace normspec {
// 8 bytes of a row, with the 16-byte loads' L2 policy (load_row_vector)
__device__ __forceinline__ uint2 load_row_half(const void* p) {
  uint2 v;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("ld.global.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
      : "=r"(v.x), "=r"(v.y)
      : "l"(p), "l"(row_l2_policy()));
#else
  asm("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
#endif
  return v;
}
template <typename T>
__device__ __forceinline__ void unpack4(const uint2& u, float (&v)[4]) {
  const uint4 q = make_uint4(u.x, u.y, 0u, 0u);
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = RawBits<T>::get(q, j);
}
template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]) {
  *reinterpret_cast<uint2*>(p) =
      make_uint2(RawBits<T>::put2(v[0], v[1]), RawBits<T>::put2(v[2], v[3]));
}
}  // namespace normspec

template <int OP, typename T, int LL>
__global__ void __launch_bounds__(256)
    normspec_fwd_quad_kernel(const T* __restrict__ x, const T* __restrict__ r,
                             const T* __restrict__ w, T* __restrict__ y, T* __restrict__ y2,
                             int rows, long long sx, long long sr, long long sy,
                             long long sy2, float eps, float offset, int flags,
                             float* __restrict__ rstd_out) {
  using namespace normspec;
  static_assert(sizeof(T) == 2 && OP != OP_GATED && (LL == 5 || LL == 6),
                "16-bit rms or fused rows of 128 or 256");
  constexpr int H = 4 << LL;
  __shared__ float red[8];  // a warp's sum, at most 256 threads
  const unsigned lane = threadIdx.x & ((1u << LL) - 1);
  const unsigned row = blockIdx.x * (blockDim.x >> LL) + (threadIdx.x >> LL);
  const bool live = row < static_cast<unsigned>(rows);
  // a team past the last row (the last block's) reads the last row, without a branch, and
  // stores nothing
  const unsigned lrow = live ? row : static_cast<unsigned>(rows) - 1;
  const unsigned tcol = lane * 4;
  const uint2 cx = load_row_half(x + lrow * sx + tcol);
  const uint2 cr = OP == OP_FUSED ? load_row_half(r + lrow * sr + tcol) : make_uint2(0u, 0u);
  const uint2 wr = *reinterpret_cast<const uint2*>(w + tcol);
  float v[4];
  unpack4<T>(cx, v);
  if constexpr (OP == OP_FUSED) {
    float rv[4];
    unpack4<T>(cr, rv);
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = add(v[j], rv[j]);
    if (flags & F_ROUNDED) round_pairs<T>(v);
  }
  float sq[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) sq[j] = mul(v[j], v[j]);
  float part = add(add(sq[0], sq[1]), add(sq[2], sq[3]));
#pragma unroll
  for (int off = 1; off < 32; off <<= 1)
    part = add(part, __shfl_xor_sync(0xffffffffu, part, off));
  if constexpr (LL == 6) {
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = part;
    __syncthreads();
    const float* q = red + ((threadIdx.x >> 5) & ~1u);
    part = add(q[0], q[1]);
  } else {
    part = __shfl_sync(0xffffffffu, part, 0);
  }
  const float rstd = rstd_from_ss(part, H, eps);
  if (!live) return;
  if (rstd_out != nullptr && lane == 0) rstd_out[row] = rstd;
  float g[4], out[4];
  unpack4<T>(wr, g);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    out[j] = mul(mul(v[j], rstd), scale_weight(g[j], flags & F_OFFSET, offset));
  store4<T>(y + row * sy + tcol, out);
  if constexpr (OP == OP_FUSED) store4<T>(y2 + row * sy2 + tcol, v);
}

// ---- backward -------------------------------------------------------------------
// The rms and fused ops' backward of one vector: dxhat = dy * g, the dweight
// contribution dy * xhat and dxhat * xhat for the row's sum, each product rounded once.
template <int VEC>
__device__ __forceinline__ void norm_backward_vec(const float (&v)[VEC], const float (&dyv)[VEC],
                                                  const float (&g)[VEC], float rstd,
                                                  float (&dxh)[VEC], float (&c)[VEC],
                                                  float (&prod)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float xhat = normspec::mul(v[k], rstd);
    dxh[k] = normspec::mul(dyv[k], g[k]);
    c[k] = normspec::mul(dyv[k], xhat);
    prod[k] = normspec::mul(dxh[k], xhat);
  }
}

// dx of one vector: rstd * (dxhat - xhat * m), m the row's mean of dxhat * xhat and
// xhat formed again as v * rstd (the same bits as before).
template <int VEC>
__device__ __forceinline__ void dx_of_vec(const float (&v)[VEC], const float (&dxh)[VEC],
                                          float rstd, float m, float (&out)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float xm = normspec::mul(normspec::mul(v[k], rstd), m);
    out[k] = normspec::mul(rstd, normspec::sub(dxh[k], xm));
  }
}

// A team reduces the dweight contributions of groups of R = 2**glog
// consecutive rows (rows beyond `rows` contribute +0.0) with a per-column
// binary-counter stack in dynamic shared memory: glog levels of NP * VEC floats
// per thread, laid out [level][pass][VEC/4][thread] as float4 (no bank
// conflicts). One fp32 row per group goes to ws[g * H + col]; with F_DW_FINAL (one
// group) the group's tree is dweight and goes to ws as H values of T instead.
//   OP_RMS:   r, dres, d2 unused.
//   OP_FUSED: r = residual, dres = gradient of the new residual, d2 = dresidual.
//   OP_FUSED_SUM: x = the sum s, dres as OP_FUSED; r, d2 unused (dx is ds).
//   OP_GATED: r = gate, dres unused, d2 = dgate.
// The register budget of two forms is capped at 80 registers (three 256-thread blocks
// per SM), which nvcc reaches by itself and NVRTC does not (so that the CuPy backend's
// binaries keep the same resident blocks): the rms norm's recomputing two-pass form of
// 128 threads (16-bit rows of 2048) and the saved-rstd one-pass forms of 32 lanes of the
// other ops (16-bit rows of 256). The other forms without a saved rstd keep nvcc's own
// budget (a minimum of one block; three made the fused one spill).//
// FULL_TL >= 0: rows that fill the team exactly (H = NP * VEC * 2**FULL_TL) with
// teams of 2**FULL_TL threads, as for the one-row forward: the geometry is
// constant and its predicates fold away.
// SAVED: rstd_in holds the forward's rstd of every row (the same bits as the
// row's reduction, which this form leaves out); otherwise rstd_in is unused.
//
// The register budget (minimum resident 256-thread blocks): the saved-rstd
// constant forms of 16-bit rows take more registers than the recomputing ones
// (ptxas, bf16: 142 against 128 for the fused 128 x 2, 79 against 61 for rms 32 x 1), which
// would cost a block per SM; capped, they keep the recomputing forms' occupancy
// without spills (two passes: 128 registers; the rms norm's one pass: 64). The
// fused and gated one-pass forms would spill at 64, so they keep their budget.
//
// GC >= 0: the gated op's convention as constants, for the gate-table launches of
// the constant forms (bf16): bit 0 the transformers convention (F_HF), bit 1 a
// weight of the input dtype (F_W_IS_INPUT); the table is on and its lookups are
// batched per vector. GC = 7: GC 3 with its weight products in packed bf16 (gated_backward_vec_hf_packed_w). GC = -1: the
// flags decide at run time. The same device functions compute every value either way.
template <int OP, typename T, int NP, int FULL_TL, bool SAVED, int GC = -1>
__host__ __device__ constexpr int bwd_min_blocks() {
  // the gate table (64 KiB) bounds these launches to two blocks per SM: up to 128
  // registers cost nothing
  if (GC >= 0) return 2;
  if (sizeof(T) == 2 &&
      ((OP == normspec::OP_RMS && !SAVED && NP == 2 && FULL_TL == 7) ||
       (OP != normspec::OP_RMS && SAVED && NP == 1 && FULL_TL == 5)))
    return 3;
  if (!SAVED || FULL_TL < 0 || sizeof(T) != 2) return 1;
  if (NP == 2) return 2;
  return OP == normspec::OP_RMS ? 4 : 1;
}

template <int OP, typename T, int NP, int FULL_TL = -1, bool SAVED = false, int GC = -1>
__global__ void __launch_bounds__(256, (bwd_min_blocks<OP, T, NP, FULL_TL, SAVED, GC>()))
    normspec_bwd_pipe_kernel(const T* __restrict__ x, const T* __restrict__ r,
                             const void* __restrict__ w, const T* __restrict__ dy,
                             const T* __restrict__ dres, T* __restrict__ dx,
                             T* __restrict__ d2, float* __restrict__ ws, long long rows,
                             long long H_arg, long long sx, long long sr, long long sdy,
                             long long sdres, long long sdx, long long sd2, float eps,
                             float offset, int flags, int team_log_arg, int glog,
                             const float* __restrict__ rstd_in = nullptr) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  constexpr int Q = VEC / 4;  // float4 per vector
  constexpr bool TWO = op_reads_second(OP);
  constexpr bool DRES = op_adds_dres(OP);
  constexpr bool TABLE_OK = OP == OP_GATED && IsBf16<T>::value;
  __shared__ float red[2][NP * 32];
  extern __shared__ float4 stk[];  // dweight stacks, weight factors, gate table
  constexpr bool FULL = FULL_TL >= 0;
  const int team_log = FULL ? FULL_TL : team_log_arg;
  const long long H = FULL ? (static_cast<long long>(NP) * VEC) << (FULL ? FULL_TL : 0) : H_arg;
  const Team tm = make_team(team_log);
  const int Hc = static_cast<int>(H);  // <= 8192: column arithmetic in 32 bits
  const int P = FULL ? Hc : static_cast<int>(next_pow2(H));
  const int S = VEC << team_log;
  const int tcol = tm.lane * VEC;
  constexpr bool GCONST = GC >= 0;
  static_assert(!GCONST || (OP == OP_GATED && TABLE_OK), "GC: gated bf16 launches only");
  static_assert(GC <= 3 || GC == 7, "GC: 0..3, or 7 (3 with packed weight products)");
  constexpr bool HF_PACKED_W = GC == 7;
  const bool hf = GCONST ? (GC & 1) != 0 : (flags & F_HF) != 0;
  const bool w_in = GCONST ? (GC & 2) != 0 : (flags & F_W_IS_INPUT) != 0;
  const bool sig = flags & F_SIGMOID;
  const bool ws_aligned = (H % 4) == 0;
  // the constant forms' block: 256 threads, or one team of 2**FULL_TL > 256 / 2 threads
  constexpr int FULL_NTHR = FULL_TL <= 5 ? 256 : 1 << (FULL ? FULL_TL : 0);
  const int nthr = FULL ? FULL_NTHR : blockDim.x;
  // rows, groups, the team's slots and every element offset (32-bit arithmetic here made
  // the rms backward slower)
  using Idx = long long;
  const Idx nrows = static_cast<Idx>(rows);
  const Idx ox = static_cast<Idx>(sx), orr = static_cast<Idx>(sr), ody = static_cast<Idx>(sdy);
  const Idx odr = static_cast<Idx>(sdres), odx = static_cast<Idx>(sdx);
  const Idx od2 = static_cast<Idx>(sd2), ows = static_cast<Idx>(H);
  const Idx R = Idx(1) << glog;
  const Idx groups = (nrows + R - 1) >> glog;  // a shift: no 64-bit division

  const bool table = GCONST || (TABLE_OK && (flags & F_GATE_TABLE));
  float4* wsm = stk + glog * NP * Q * nthr;
  float2* tab = reinterpret_cast<float2*>(wsm + weight_float4s<NP, VEC>(team_log));
  const Idx lead = static_cast<Idx>(tm.lead), nslots = static_cast<Idx>(tm.nslots);
  const Idx mine = static_cast<Idx>(tm.slot - tm.lead);
  // chained tree launches follow (normspec::chained_launches): they wait for this grid
  if (flags & F_LET_DEPENDENTS) let_dependents_launch();
  uint4 cx[NP], cr[NP], cdy[NP], cdr[NP], nx[NP], nr[NP], ndy[NP], ndr[NP];
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  float nrs = 1.0f;  // the next row's saved rstd
  // one row's loads into a row set (the next row's: nx, nr, ndy, ndr, nrs)
  auto load_set = [&](Idx row, uint4(&bx)[NP], uint4(&br)[NP], uint4(&bdy)[NP],
                      uint4(&bdr)[NP], float& brs) {
    if constexpr (SAVED) brs = __ldg(rstd_in + row);
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const int col = p * S + tcol;
      bx[p] = load_raw<T>(x + row * ox, col, Hc);
      if (TWO) br[p] = load_raw<T>(r + row * orr, col, Hc);
      bdy[p] = load_raw<T>(dy + row * ody, col, Hc);
      if (DRES) bdr[p] = load_raw<T>(dres + row * odr, col, Hc);
    }
  };
  auto prefetch = [&](Idx row) { load_set(row, nx, nr, ndy, ndr, nrs); };
  // The GC forms keep two rows in flight per team: while a row is computed, the next
  // one's loads were issued a row earlier and the one after it is issued now (a second
  // row set). Only when loads issue changes, never a value.
  constexpr bool DEPTH2 = GCONST;
  uint4 mx[NP], mr[NP], mdy[NP], mdr[NP];
  float mrs = 1.0f;
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    nx[p] = nr[p] = ndy[p] = ndr[p] = zero;
    mx[p] = mr[p] = mdy[p] = mdr[p] = zero;
  }
  {
    const Idx gi = lead + mine;
    if (gi < groups) prefetch(gi * R);  // row gi * R < rows for every group
    if constexpr (DEPTH2) {  // the team's second row: the group's next, or the next group's first
      if (R > 1) {
        if (gi < groups && gi * R + 1 < nrows) load_set(gi * R + 1, mx, mr, mdy, mdr, mrs);
      } else if (gi + nslots < groups) {
        load_set((gi + nslots) * R, mx, mr, mdy, mdr, mrs);
      }
    }
  }
  // the weight factors and the gate table while the first rows are in flight
  if constexpr (FULL) {
    fill_weight_smem_batched<OP, T, NP, VEC, (FULL ? FULL_TL : 0), FULL_NTHR>(wsm, w, Hc,
                                                                             offset, flags);
  } else {
    fill_weight_smem<OP, T, NP, VEC>(wsm, w, team_log, Hc, offset, flags);
  }
  if (table) fill_act_grad_table(tab, sig);
  __syncthreads();
  int buf = 0;
  for (Idx g0 = lead; g0 < groups; g0 += nslots) {
    const Idx gi = g0 + mine;
    const bool group_ok = gi < groups;
    for (Idx j = 0; j < R; ++j) {
      const Idx row = gi * R + j;
      const bool active = group_ok && row < nrows;
      // the row after this one in the team's sequence
      const Idx nrow = (j + 1 < R) ? row + 1 : (gi + nslots) * R;
      const bool nactive = (j + 1 < R) ? (group_ok && nrow < nrows) : (gi + nslots < groups);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        cx[p] = active ? nx[p] : zero;
        cr[p] = active ? nr[p] : zero;
        cdy[p] = active ? ndy[p] : zero;
        cdr[p] = active ? ndr[p] : zero;
      }
      const float crs = active ? nrs : 1.0f;
      if constexpr (DEPTH2) {
        // the next row's set was loaded a row ago; the row after it is loaded now. A row
        // exists (its loads were issued) exactly when it is active where it is computed.
        Idx mrow;
        bool mactive;
        if (j + 2 < R) {
          mrow = row + 2;
          mactive = group_ok && mrow < nrows;
        } else if (j + 1 < R) {  // the next row is the group's last
          mrow = (gi + nslots) * R;
          mactive = gi + nslots < groups;
        } else if (R > 1) {  // this row is the group's last: the next group's second row
          mrow = (gi + nslots) * R + 1;
          mactive = gi + nslots < groups && mrow < nrows;
        } else {  // one row a group: the group after the next
          mrow = (gi + nslots + nslots) * R;
          mactive = gi + nslots + nslots < groups;
        }
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          nx[p] = mx[p];
          nr[p] = mr[p];
          ndy[p] = mdy[p];
          ndr[p] = mdr[p];
        }
        nrs = mrs;
        if (mactive) load_set(mrow, mx, mr, mdy, mdr, mrs);
      } else {
        if (nactive) prefetch(nrow);
      }

      // the saved rstd, or the row's reduction (inactive rows: any finite value)
      // Each reduction takes the other half of red than the one before, so that a warp
      // writing its partial never meets one still reading the last reduction's (the
      // barrier of the reduction in between orders them). With SAVED there is one
      // reduction a row; flipping here too would send every row's to the same half.
      float rstd = crs;
      if constexpr (!SAVED) {
        rstd = row_rstd<OP, T, NP>(cx, cr, flags, tcol, S, Hc, P, eps, team_log, red[buf]);
        buf ^= 1;
      }
      float part[NP];

      // dxhat, dgate, the dweight contribution (pushed) and sum(dxhat * xhat).
      // dxhat stays in registers for dx below: recomputing dy * g there instead
      // (one LDS.128 per four elements and a multiply) made the rms backward slower
      // (issue-bound), for no fewer registers.
      float dxh[NP][VEC];
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = p * S + tcol;
        float v[VEC], dyv[VEC], prod[VEC], c[VEC], g[VEC];
        norm_input_raw<OP, T>(cx[p], cr[p], flags, v);
        unpack<T>(cdy[p], dyv);
        weight_of<VEC>(wsm, p, tm.lane, team_log, g);
        if constexpr (OP == OP_GATED) {
          float z[VEC], dg[VEC];
          unpack<T>(cr[p], z);
          // GC: the vector's lookups and arithmetic at once, the convention's roundings
          // two values per conversion; otherwise one element at a time (the runtime form
          // would hold the vector's pairs in more registers)
          if constexpr (GCONST) {
            Act acts[VEC];
            act_grads_from_table<VEC>(tab, z, sig, acts);
            float xh[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k) xh[k] = mul(v[k], rstd);
            if constexpr (HF_PACKED_W)
              gated_backward_vec_hf_packed_w<T, VEC>(xh, g, acts, dyv, dg, dxh[p], c);
            else
              gated_backward_vec<T, VEC>(xh, g, acts, dyv, hf, w_in, dg, dxh[p], c);
#pragma unroll
            for (int k = 0; k < VEC; ++k) prod[k] = mul(dxh[p][k], xh[k]);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float xhat = mul(v[k], rstd);
              const Act act =
                  table ? act_grad_from_table(tab, z[k], sig) : act_and_grad_fp32(z[k], sig);
              const GatedGrad gg = gated_backward_act<T>(xhat, g[k], act, dyv[k], hf, w_in);
              dg[k] = gg.dg;
              dxh[p][k] = gg.dxh;
              c[k] = gg.contrib;
              prod[k] = mul(dxh[p][k], xhat);
            }
          }
          if (active && col < Hc) store_row<T>(d2 + row * od2, col, Hc, dg);
        } else {
          norm_backward_vec<VEC>(v, dyv, g, rstd, dxh[p], c, prod);
        }
        zero_beyond<VEC>(c, col, Hc);
        zero_beyond<VEC>(prod, col, Hc);
        part[p] = local_tree<VEC>(prod, P);
        if (!active) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) c[k] = 0.0f;
        }
        // push c onto the stack of this pass: level l holds a left sibling
        int l = 0;
        for (; l < glog && ((j >> l) & 1); ++l) {
#pragma unroll
          for (int q = 0; q < Q; ++q)
            add_left_sibling(stk[((l * NP + p) * Q + q) * nthr + threadIdx.x], c + 4 * q);
        }
        if (l < glog) {
#pragma unroll
          for (int q = 0; q < Q; ++q)
            stk[((l * NP + p) * Q + q) * nthr + threadIdx.x] =
                make_float4(c[4 * q], c[4 * q + 1], c[4 * q + 2], c[4 * q + 3]);
        } else if (group_ok && col < Hc) {  // j == R - 1: the group's tree
          if (flags & F_DW_FINAL)  // the only group (gi == 0): dweight itself
            store_row<T>(reinterpret_cast<T*>(ws), col, Hc, c);
          else
            store_vec<float, VEC>(ws + gi * ows, col, Hc, ws_aligned, c);
        }
      }
      team_reduce_pipe<NP, VEC>(part, P, team_log, red[buf]);
      buf ^= 1;
      const float m = div_by_count(fold_passes<NP>(part, S, P), H);

      // dx (and dresidual)
      if (active) {
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          const int col = p * S + tcol;
          if (col < Hc) {
            float v[VEC], out[VEC];
            norm_input_raw<OP, T>(cx[p], cr[p], flags, v);
            dx_of_vec<VEC>(v, dxh[p], rstd, m, out);
            if constexpr (DRES) {
              float dr[VEC];
              unpack<T>(cdr[p], dr);
              if (flags & F_ROUNDED) round_pairs<T>(out);  // the rounded sum's gradient
#pragma unroll
              for (int k = 0; k < VEC; ++k) out[k] = add(out[k], dr[k]);
              if constexpr (OP == OP_FUSED) store_row<T>(d2 + row * od2, col, Hc, out);
            }
            store_row<T>(dx + row * odx, col, Hc, out);
          }
        }
      }
    }
  }
}

// The rms backward of one row per team, without the pipelined kernel's machinery: no
// group loop, no dweight stacks, no prefetch of a next row, and the weight's factors
// loaded to registers (weight_factors, as the one-row forward reads them) instead of
// through shared memory and a barrier. For plans of one row per dweight group (glog = 0)
// in the constant geometries (FULL_TL: teams of 2**FULL_TL threads, NP passes, rows of
// exactly NP * VEC << FULL_TL elements). Such launches are bound by one row's latency,
// and most of the pipelined kernel's instructions there were integer and control work.
// The same device functions compute every value, so the bits are the pipelined
// kernel's. ws: row r's dweight contributions at ws[r * H] (fp32), or with F_DW_FINAL
// (one row) dweight itself, H values of T. SAVED: rstd_in holds the forward's rstd.
// Teams of 64 and more lanes are whole blocks, one per row (launch_bwd_row), so their
// row is blockIdx.x and every team has one: no 64-bit team arithmetic and no past-the-end
// guards before the first load.
template <typename T, int NP, int FULL_TL, bool SAVED>
__global__ void __launch_bounds__(256)
    normspec_bwd_row_kernel(const T* __restrict__ x, const void* __restrict__ w,
                            const T* __restrict__ dy, T* __restrict__ dx,
                            float* __restrict__ ws, long long rows, long long sx,
                            long long sdy, long long sdx, float eps, float offset, int flags,
                            const float* __restrict__ rstd_in) {
  using namespace normspec;
  constexpr int OP = OP_RMS;
  constexpr int VEC = VecOf<T>::value;
  constexpr int S = VEC << FULL_TL;
  constexpr int H = NP * S;  // a power of two: the row's tree has no padding
  __shared__ float red[2][NP * 32];
  constexpr bool PER_BLOCK = FULL_TL >= 6;
  const Team tm = make_team(FULL_TL);
  const int tcol = tm.lane * VEC;  // (the mask tells the compiler tcol < H)
  const long long row = PER_BLOCK ? static_cast<long long>(blockIdx.x) : tm.slot;
  const bool active = PER_BLOCK || row < rows;
  // chained tree launches follow (normspec::chained_launches): they wait for this grid
  if (flags & F_LET_DEPENDENTS) let_dependents_launch();
  uint4 cx[NP], cdy[NP];
  float rstd = 1.0f;  // inactive rows: any finite value
#pragma unroll
  for (int p = 0; p < NP; ++p) cx[p] = cdy[p] = make_uint4(0u, 0u, 0u, 0u);
  if (active) {
    if constexpr (SAVED) rstd = __ldg(rstd_in + row);
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      cx[p] = load_raw<T>(x + row * sx, p * S + tcol, H);
      cdy[p] = load_raw<T>(dy + row * sdy, p * S + tcol, H);
    }
  }
  float g[NP][VEC];
#pragma unroll
  for (int p = 0; p < NP; ++p)
    weight_factors<OP, T, VEC>(w, p * S + tcol, H, offset, flags, g[p]);
  if constexpr (!SAVED)
    rstd = row_rstd<OP, T, NP>(cx, cx, flags, tcol, S, H, H, eps, FULL_TL, red[0]);

  float dxh[NP][VEC], part[NP];
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    const int col = p * S + tcol;  // col + VEC <= H: every vector is whole
    float v[VEC], dyv[VEC], c[VEC], prod[VEC];
    norm_input_raw<OP, T>(cx[p], cx[p], flags, v);
    unpack<T>(cdy[p], dyv);
    norm_backward_vec<VEC>(v, dyv, g[p], rstd, dxh[p], c, prod);
    part[p] = local_tree<VEC>(prod, H);
    if (active) {  // the row's group of one: its contributions are the group's tree
      if (flags & F_DW_FINAL)
        store_row<T>(reinterpret_cast<T*>(ws), col, H, c);
      else
        store_vec<float, VEC>(ws + row * H, col, H, true, c);
    }
  }
  team_reduce_pipe<NP, VEC>(part, H, FULL_TL, red[1]);
  const float m = div_by_count(fold_passes<NP>(part, S, H), H);
  if (active) {
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      float v[VEC], out[VEC];
      norm_input_raw<OP, T>(cx[p], cx[p], flags, v);
      dx_of_vec<VEC>(v, dxh[p], rstd, m, out);
      store_row<T>(dx + row * sdx, p * S + tcol, H, out);
    }
  }
}
