// The gated norm's backward for the GDN shapes, two rows a team per iteration.
//
// normspec_bwd_pipe_kernel's gate-table constant forms (GC >= 0: bf16 rows of 128 or 256
// elements, one 16-byte vector a lane, the forward's rstd saved) spent most of their
// instructions on other than float work: per-row bookkeeping in 64 bits, row sets copied
// and masked, the weight factors read from shared memory and the kernel parameters
// re-read every row, a branch-laden dweight stack push per row. FLA's loop takes two rows
// a lane per iteration. This kernel is that shape for those launches only:
//
//   * a team (2**TL lanes, one vector each) computes two consecutive rows of its dweight
//     group per iteration, while the next two rows' loads are in flight (two rows ahead,
//     as the pipelined kernel's GC forms keep);
//   * the pair's dweight contributions meet in registers, add(c[j], c[j + 1]): the
//     bottom level of the group's tree, the very sum the binary-counter stack forms
//     there, so the stack in shared memory keeps glog - 1 levels and is touched once a
//     pair;
//   * the weight factors stay in the lane's registers (its columns never change);
//   * rows, strides and the team's slots are 32-bit (the launcher checks that every
//     element offset fits: offsets_fit_32);
//   * the two rows' reductions of sum(dxhat * xhat) shuffle side by side
//     (team_reduce_pipe with the pair as its two "passes": the same tree per row);
//   * the gate table's slots are formed two gates at a time from the raw 32-bit words
//     (act_grads_of_raw), its entries read by byte offset, the stores unconditional
//     16-byte vectors (every row is whole).
//
// Every value comes from the same device functions as in the pipelined kernel, in the
// same order (the table's entries or the declared function, gated_backward_vec or its
// packed-weight form, the row's local tree and team butterfly, dx_of_vec, the dweight
// group tree), so the bits are the spec's exactly as there. Groups need at least two
// rows (glog >= 1); the launcher keeps the pipelined kernel for glog 0.
//
// It is faster than the pipelined GC form on the GDN shapes.
#pragma once

#include "normspec_pipe.cuh"

namespace normspec {

// The raw vectors of one row of the gated backward, and its saved rstd.
struct GatedRowRaw {
  uint4 x, z, dy;
  float rstd;
};

// A row's loads (x, gate, dy and the saved rstd) at 32-bit element offsets.
template <typename T>
__device__ __forceinline__ void load_gated_row(GatedRowRaw& r, const T* __restrict__ x,
                                               const T* __restrict__ z,
                                               const T* __restrict__ dy,
                                               const float* __restrict__ rstd_in, int row,
                                               int sx, int sz, int sdy, int tcol) {
  r.rstd = __ldg(rstd_in + row);
  r.x = load_row_vector(reinterpret_cast<const uint4*>(x + (row * sx + tcol)));
  r.z = load_row_vector(reinterpret_cast<const uint4*>(z + (row * sz + tcol)));
  r.dy = load_row_vector(reinterpret_cast<const uint4*>(dy + (row * sdy + tcol)));
}

// The table entries of the eight bf16 gates of a raw vector, two gates per 32-bit word at
// once. Per half, t = (bits & 0x7fff) - (GATE_TABLE_E0 << 7) is gate_slot's t: the gate
// lies in the table exactly when t < 4096, and its entry is at byte 8 * t, plus 0x8000 for
// a negative gate (slot 4096 + t). One 32-bit subtraction forms both halves' t: the upper
// half is right whenever the lower one is in the table (no borrow), and a lower half out
// of the table shows in its own bits 12..15, so "any of bits 12..15 set in any half"
// catches every gate outside the table. Then, rarely, the vector's gates are looked up
// again one by one (gate_slot), those outside evaluated by the declared function
// (act_grad_cold): the entries read, and so the bits, are gate_slot's.
__device__ __forceinline__ void act_grads_of_raw(const float2* __restrict__ tab, const uint4& zr,
                                                 bool sig, Act (&a)[8]) {
  const unsigned int words[4] = {zr.x, zr.y, zr.z, zr.w};
  constexpr unsigned int E2 = (GATE_TABLE_E0 << 7) * 0x10001u;
  unsigned int seen = 0u;
  const char* base = reinterpret_cast<const char*>(tab);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const unsigned int t = (words[q] & 0x7fff7fffu) - E2;
    seen |= t;
    // byte offsets of both halves' entries: in [0, 0x10000), 8-byte aligned, even for
    // gates outside the table (whose reads are then replaced)
    const unsigned int off = ((t & 0x0fff0fffu) << 3) | (words[q] & 0x80008000u);
    const float2 lo = *reinterpret_cast<const float2*>(base + (off & 0xffffu));
    const float2 hi = *reinterpret_cast<const float2*>(base + (off >> 16));
    a[2 * q].a = lo.x;
    a[2 * q].da = lo.y;
    a[2 * q + 1].a = hi.x;
    a[2 * q + 1].da = hi.y;
  }
  if (seen & 0xf000f000u) {
    float z[8];
    unpack<__nv_bfloat16>(zr, z);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      bool miss;
      const int slot = gate_slot(z[k], miss);
      if (miss) {
        a[k] = act_grad_cold(z[k], sig);
      } else {
        const float2 v = tab[slot];
        a[k].a = v.x;
        a[k].da = v.y;
      }
    }
  }
}

// Eight values rounded to T (two per conversion) and stored as one 16-byte vector.
template <typename T>
__device__ __forceinline__ void store_vector8(T* __restrict__ p, const float (&v)[8]) {
  store_row_vector(reinterpret_cast<uint4*>(p),
                   make_uint4(RawBits<T>::put2(v[0], v[1]), RawBits<T>::put2(v[2], v[3]),
                              RawBits<T>::put2(v[4], v[5]), RawBits<T>::put2(v[6], v[7])));
}

// Eight fp32 values as two 16-byte stores.
__device__ __forceinline__ void store_float8(float* __restrict__ p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// The lane's part of one row: dgate stored (when the row is active), dxhat kept for dx,
// the dweight contributions c (zeros for an inactive row) and the row's local tree of
// dxhat * xhat.
template <typename T, int GC>
__device__ __forceinline__ float gated_pair_row(const GatedRowRaw& r, const float (&g)[8],
                                                const float2* __restrict__ tab, bool sig,
                                                bool active, T* __restrict__ dz, int sdz,
                                                int row, int tcol, float (&dxh)[8],
                                                float (&c)[8]) {
  constexpr int VEC = 8;
  constexpr bool hf = (GC & 1) != 0;
  constexpr bool w_in = (GC & 2) != 0;
  float v[VEC], dyv[VEC], dg[VEC], xh[VEC], prod[VEC];
  unpack<T>(r.x, v);
  unpack<T>(r.dy, dyv);
  Act acts[VEC];
  act_grads_of_raw(tab, r.z, sig, acts);
#pragma unroll
  for (int k = 0; k < VEC; ++k) xh[k] = mul(v[k], r.rstd);
  if constexpr (GC == 7)
    gated_backward_vec_hf_packed_w<T, VEC>(xh, g, acts, dyv, dg, dxh, c);
  else
    gated_backward_vec<T, VEC>(xh, g, acts, dyv, hf, w_in, dg, dxh, c);
#pragma unroll
  for (int k = 0; k < VEC; ++k) prod[k] = mul(dxh[k], xh[k]);
  if (active) {
    store_vector8<T>(dz + (row * sdz + tcol), dg);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) c[k] = 0.0f;
  }
  return local_tree<VEC>(prod, VEC);
}

// dx of one row from its raw x, dxhat, rstd and m (the row's mean of dxhat * xhat).
template <typename T>
__device__ __forceinline__ void gated_pair_dx(const uint4& rx, const float (&dxh)[8], float rstd,
                                              float m, T* __restrict__ dxrow) {
  float v[8], out[8];
  unpack<T>(rx, v);
  dx_of_vec<8>(v, dxh, rstd, m, out);
  store_vector8<T>(dxrow, out);
}

// TL: lanes a team (log2; 4 or 5: rows of 128 or 256 bf16). GC: the convention as
// constants, as normspec_bwd_pipe_kernel's (0, 1, 3 or 7). ws: the groups' fp32 dweight
// rows (ws[group * H]), or with F_DW_FINAL (one group) dweight itself as H values of T.
// Dynamic shared memory: the table (64 KiB), then (glog - 1) stack levels of 8 floats a
// thread. groups: the dweight groups, ceil(rows / 2**glog).
template <typename T, int TL, int GC>
__global__ void __launch_bounds__(256, 2)
    normspec_gated_bwd_pair_kernel(const T* __restrict__ x, const T* __restrict__ z,
                                   const void* __restrict__ w, const T* __restrict__ dy,
                                   T* __restrict__ dx, T* __restrict__ dz,
                                   float* __restrict__ ws, int rows, int sx, int sz, int sdy,
                                   int sdx, int sdz, float offset, int flags, int glog,
                                   int groups, const float* __restrict__ rstd_in) {
  static_assert(IsBf16<T>::value, "the gate table holds bf16 gates");
  static_assert(TL == 4 || TL == 5, "one vector a lane, teams within a warp");
  static_assert(GC == 0 || GC == 1 || GC == 3 || GC == 7, "GC: 0, 1, 3 or 7");
  constexpr int VEC = 8;
  constexpr int Q = VEC / 4;
  constexpr int H = VEC << TL;
  extern __shared__ float4 dyn[];  // gate table, then dweight stacks (levels 1 .. glog - 1)
  const int lane = static_cast<int>(threadIdx.x) & ((1 << TL) - 1);
  const int tcol = lane * VEC;
  // the warp's first team and this team's place in it: the loop is uniform per warp,
  // so the full-mask shuffles never diverge
  const int lead = static_cast<int>((blockIdx.x * 256u + threadIdx.x) >> 5) << (5 - TL);
  const int mine = (static_cast<int>(threadIdx.x) & 31) >> TL;
  const int nslots = static_cast<int>((gridDim.x * 256u) >> TL);
  const int R = 1 << glog;
  const bool sig = (flags & F_SIGMOID) != 0;
  float2* tab = reinterpret_cast<float2*>(dyn);
  float4* stk = dyn + GATE_TABLE_SLOTS / 2;
  if (flags & F_LET_DEPENDENTS) let_dependents_launch();

  // the first pair's loads, then the weight factors and the table while they fly
  GatedRowRaw n0, n1;
  n0.x = n0.z = n0.dy = n1.x = n1.z = n1.dy = make_uint4(0u, 0u, 0u, 0u);
  n0.rstd = n1.rstd = 1.0f;
  {
    const int gi = lead + mine;
    const int row = gi * R;
    if (gi < groups) load_gated_row<T>(n0, x, z, dy, rstd_in, row, sx, sz, sdy, tcol);
    if (gi < groups && row + 1 < rows)
      load_gated_row<T>(n1, x, z, dy, rstd_in, row + 1, sx, sz, sdy, tcol);
  }
  float g[VEC];
  weight_factors<OP_GATED, T, VEC>(w, tcol, H, offset, flags, g);
  fill_act_grad_table(tab, sig);
  __syncthreads();

  // The team's pairs in order: (g0, j), j = 0, 2, .., R - 2, then g0 + nslots (g0 and j
  // the same in every lane of the warp). Each iteration computes rows j and j + 1 of the
  // team's group from c0 and c1 while the next pair's loads go to n0 and n1.
  // (The row sets trading roles, two pairs an iteration so that none is copied, ran no
  // faster.)
  for (int g0 = lead, j = 0; g0 < groups;) {
    const GatedRowRaw c0 = n0, c1 = n1;
    const int gi = g0 + mine;
    const bool group_ok = gi < groups;
    const int row = gi * R + j;
    const bool a0 = group_ok && row < rows;
    const bool a1 = group_ok && row + 1 < rows;
    // the next pair: this group's, or the first of the team's next group
    const int nrow = j + 2 < R ? row + 2 : (gi + nslots) * R;
    const bool nok = j + 2 < R ? group_ok : gi + nslots < groups;
    if (nok && nrow < rows) load_gated_row<T>(n0, x, z, dy, rstd_in, nrow, sx, sz, sdy, tcol);
    if (nok && nrow + 1 < rows)
      load_gated_row<T>(n1, x, z, dy, rstd_in, nrow + 1, sx, sz, sdy, tcol);

    float dxh0[VEC], dxh1[VEC], cc[VEC], c1v[VEC], part[2];
    part[0] = gated_pair_row<T, GC>(c0, g, tab, sig, a0, dz, sdz, row, tcol, dxh0, cc);
    part[1] = gated_pair_row<T, GC>(c1, g, tab, sig, a1, dz, sdz, row + 1, tcol, dxh1, c1v);
    // the group tree's bottom level: row j is the left sibling of row j + 1
#pragma unroll
    for (int k = 0; k < VEC; ++k) cc[k] = add(cc[k], c1v[k]);
    // the pair's sum is node j / 2 of level 1: add the left siblings the stack holds
    int l = 1;
    for (; l < glog && (((j >> 1) >> (l - 1)) & 1); ++l) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
        add_left_sibling(stk[((l - 1) * Q + q) * 256 + threadIdx.x], cc + 4 * q);
    }
    if (l < glog) {
#pragma unroll
      for (int q = 0; q < Q; ++q)
        stk[((l - 1) * Q + q) * 256 + threadIdx.x] =
            make_float4(cc[4 * q], cc[4 * q + 1], cc[4 * q + 2], cc[4 * q + 3]);
    } else if (group_ok) {  // the group's last pair: its tree
      if (flags & F_DW_FINAL)  // the only group: dweight itself
        store_vector8<T>(reinterpret_cast<T*>(ws) + tcol, cc);
      else
        store_float8(ws + (static_cast<long long>(gi) * H + tcol), cc);
    }
    team_reduce_pipe<2, VEC>(part, H, TL, nullptr);
    const float m0 = div_by_count(part[0], H);
    const float m1 = div_by_count(part[1], H);
    if (a0) gated_pair_dx<T>(c0.x, dxh0, c0.rstd, m0, dx + (row * sdx + tcol));
    if (a1) gated_pair_dx<T>(c1.x, dxh1, c1.rstd, m1, dx + ((row + 1) * sdx + tcol));
    j += 2;
    if (j == R) {
      j = 0;
      g0 += nslots;
    }
  }
}

}  // namespace normspec
