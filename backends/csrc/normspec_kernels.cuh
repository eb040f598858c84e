// normspec CUDA kernels: bitwise equal to spec/ for every input.
//
// This file includes no torch header: the torch extension launches the kernels
// through normspec_launch.cu (torch-free) from normspec_cuda.cpp, and the CuPy
// backend compiles this file as it is through NVRTC
// (RawModule with name_expressions for the templates). Every launch
// parameter is an explicit argument: pointers, rows, H, row strides (in
// elements), eps, offset and flag bits (see normspec_arith.h).
//
// Reductions follow the spec's pairwise tree: the row is zero-padded to
// P = next_pow2(H) and every partial sum is the tree of an aligned
// power-of-two segment of that padded row:
//   * a thread holds VEC = 16 / sizeof(T) contiguous elements per pass and
//     folds them pairwise (only up to P when P < VEC);
//   * lanes combine with xor-shuffles at offsets 1, 2, 4, 8, 16 (a lane's
//     segment sits next to its neighbour's), warps likewise through shared
//     memory, as long as the covered segment is smaller than P;
//   * a team (one warp or one block) handles a row; a pass covers
//     S = threads * VEC elements, and the passes are folded as a tree of
//     their own (register kernels) or through a binary-counter stack
//     (streaming kernels, for rows too long to hold in registers).
// Padding elements are literal +0.0 summands, exactly as in the spec (this
// matters: -0.0 + +0.0 = +0.0).
//
// dweight: each team reduces its contributions over an aligned group of
// R = 2**glog consecutive rows (a subtree of the spec's row tree) with a
// per-column binary-counter stack in registers and writes one fp32 row per
// group to the workspace; normspec_col_tree_kernel then folds the groups
// (C = 16 at a time) until one row is left.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "normspec_arith.h"

namespace normspec {

// ---- programmatic dependent launch (sm_90 and later; no-ops elsewhere) ----------
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization
// (normspec::launch_chained) may start while the kernel before it in the stream
// still runs: it calls wait_for_previous_grid() before touching memory, which
// returns once that grid has completed and its writes are visible. The kernel
// before it calls let_dependents_launch() to let such a launch start early.
// Launched without the attribute (the CuPy backend, CUDA graph capture), both
// return at once.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// ---- dtype I/O ------------------------------------------------------------------
template <typename T>
struct DevIO;

template <>
struct DevIO<float> {
  static __device__ __forceinline__ float rt(float v) { return v; }
};

template <>
struct DevIO<__nv_bfloat16> {
  static __device__ __forceinline__ float from_bits(unsigned int b) {
    return __uint_as_float(b << 16);
  }
  static __device__ __forceinline__ unsigned int to_bits(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
  static __device__ __forceinline__ float rt(float v) { return from_bits(to_bits(v)); }
  // lo and hi rounded to nearest as one packed word (lo in the low half): one
  // cvt.rn.bf16x2.f32 from sm_80, the same bits as two to_bits
  static __device__ __forceinline__ unsigned int to_bits2(float lo, float hi) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned int*>(&p);
  }
};

template <>
struct DevIO<__half> {
  static __device__ __forceinline__ float from_bits(unsigned int b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  static __device__ __forceinline__ unsigned int to_bits(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
  static __device__ __forceinline__ float rt(float v) { return from_bits(to_bits(v)); }
  // as DevIO<__nv_bfloat16>::to_bits2: one cvt.rn.f16x2.f32 from sm_80
  static __device__ __forceinline__ unsigned int to_bits2(float lo, float hi) {
    const __half2 p = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned int*>(&p);
  }
};

// Elements per 16-byte vector.
template <typename T>
struct VecOf {
  static constexpr int value = 16 / static_cast<int>(sizeof(T));
};

// Load VEC elements of a row starting at col (zeros beyond H), as fp32.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ row, long long col, long long H,
                                         bool aligned, float (&out)[VEC]) {
  if constexpr (sizeof(T) == 4) {
    const float* p = reinterpret_cast<const float*>(row) + col;
    if (aligned && col + VEC <= H) {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q) {
        const float4 f = reinterpret_cast<const float4*>(p)[q];
        out[4 * q] = f.x;
        out[4 * q + 1] = f.y;
        out[4 * q + 2] = f.z;
        out[4 * q + 3] = f.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[j] = (col + j < H) ? p[j] : 0.0f;
    }
  } else {
    const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + col;
    if (aligned && col + VEC <= H) {
#pragma unroll
      for (int q = 0; q < VEC / 8; ++q) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[q];
        const unsigned int wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const unsigned int b = (k & 1) ? (wd[k >> 1] >> 16) : (wd[k >> 1] & 0xffffu);
          out[8 * q + k] = DevIO<T>::from_bits(b);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[j] = (col + j < H) ? DevIO<T>::from_bits(p[j]) : 0.0f;
    }
  }
}

// Store VEC fp32 values rounded to T at row[col ...] (only those below H).
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* __restrict__ row, long long col, long long H,
                                          bool aligned, const float (&v)[VEC]) {
  if constexpr (sizeof(T) == 4) {
    float* p = reinterpret_cast<float*>(row) + col;
    if (aligned && col + VEC <= H) {
#pragma unroll
      for (int q = 0; q < VEC / 4; ++q)
        reinterpret_cast<float4*>(p)[q] =
            make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (col + j < H) p[j] = v[j];
    }
  } else {
    unsigned short* p = reinterpret_cast<unsigned short*>(row) + col;
    if (aligned && col + VEC <= H) {
#pragma unroll
      for (int q = 0; q < VEC / 8; ++q) {
        unsigned int wd[4];
#pragma unroll
        for (int k = 0; k < 4; ++k)
          wd[k] = DevIO<T>::to_bits(v[8 * q + 2 * k]) |
                  (DevIO<T>::to_bits(v[8 * q + 2 * k + 1]) << 16);
        reinterpret_cast<uint4*>(p)[q] = make_uint4(wd[0], wd[1], wd[2], wd[3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (col + j < H) p[j] = static_cast<unsigned short>(DevIO<T>::to_bits(v[j]));
    }
  }
}

// VEC fp32 weights (zeros beyond H).
template <int VEC>
__device__ __forceinline__ void load_w(const float* __restrict__ w, long long col, long long H,
                                       bool aligned, float (&out)[VEC]) {
  load_vec<float, VEC>(w, col, H, aligned, out);
}

// ---- the tree ---------------------------------------------------------------------
// Fold VEC thread-local values (segment [0, VEC) of the thread) down to the
// tree of the first min(VEC, P) of them. Bound: long long here, int in the
// pipelined kernels (rows of at most 8192 elements: 32-bit compares).
template <int VEC, typename Bound>
__device__ __forceinline__ float local_tree(float (&a)[VEC], Bound P) {
#pragma unroll
  for (int s = VEC; s > 1; s >>= 1) {
    if (s <= P) {
#pragma unroll
      for (int i = 0; i < s / 2; ++i) a[i] = add(a[2 * i], a[2 * i + 1]);
    }
  }
  return a[0];
}

// Team reduction of NP per-pass partial sums (each the tree of a thread's VEC
// elements): afterwards every thread of the team holds, for each pass, the
// tree of that pass's segment (or of [0, P) when P is shorter). red is
// [NP][32] floats of shared memory (used by multi-warp teams only).
template <int NP, int VEC>
__device__ __forceinline__ void team_reduce(float (&part)[NP], long long P, float* red) {
  const unsigned full = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    if (static_cast<long long>(VEC) * off < P) {
#pragma unroll
      for (int p = 0; p < NP; ++p) part[p] = add(part[p], __shfl_xor_sync(full, part[p], off));
    }
  }
  if (nwarps == 1) {
#pragma unroll
    for (int p = 0; p < NP; ++p) part[p] = __shfl_sync(full, part[p], 0);
    return;
  }
  if (lane == 0) {
#pragma unroll
    for (int p = 0; p < NP; ++p) red[p * 32 + warp] = part[p];
  }
  __syncthreads();
#pragma unroll
  for (int p = 0; p < NP; ++p) part[p] = lane < nwarps ? red[p * 32 + lane] : 0.0f;
  for (int off = 1; off < nwarps; off <<= 1) {
    if (32LL * VEC * off < P) {
#pragma unroll
      for (int p = 0; p < NP; ++p) part[p] = add(part[p], __shfl_xor_sync(full, part[p], off));
    }
  }
#pragma unroll
  for (int p = 0; p < NP; ++p) part[p] = __shfl_sync(full, part[p], 0);
}

// Fold the per-pass segment trees (segment S) into the tree of [0, P).
template <int NP, typename Bound>
__device__ __forceinline__ float fold_passes(float (&part)[NP], Bound S, Bound P) {
#pragma unroll
  for (int s = NP; s > 1; s >>= 1) {
    if (static_cast<Bound>(s) * S <= P) {
#pragma unroll
      for (int i = 0; i < s / 2; ++i) part[i] = add(part[2 * i], part[2 * i + 1]);
    }
  }
  return part[0];
}

// Binary-counter stack for a tree over a stream of equal-size segments: push
// segment j; after the last push of a power-of-two count the value returned
// is the tree of them all.
__device__ __forceinline__ float stack_push(float* stk, long long j, float v) {
  int l = 0;
  while ((j >> l) & 1) {
    v = add(stk[l], v);
    ++l;
  }
  stk[l] = v;
  return v;
}

// ---- per-element pieces -------------------------------------------------------------
// The fp32 value the norm reads: x, or the residual sum (rounded on request).
template <int OP, typename T, int VEC>
__device__ __forceinline__ void load_norm_input(const T* __restrict__ xr, const T* __restrict__ rr,
                                                long long col, long long H, bool aligned,
                                                int flags, float (&v)[VEC]) {
  load_vec<T, VEC>(xr, col, H, aligned, v);
  if constexpr (OP == OP_FUSED) {
    float r[VEC];
    load_vec<T, VEC>(rr, col, H, aligned, r);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      v[j] = add(v[j], r[j]);
      if (flags & F_ROUNDED) v[j] = DevIO<T>::rt(v[j]);
    }
  }
}

// Thread-local tree of the squares of v (padding beyond H is +0.0).
template <int VEC>
__device__ __forceinline__ float local_sum_sq(const float (&v)[VEC], long long col, long long H,
                                              long long P) {
  float a[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) a[j] = (col + j < H) ? mul(v[j], v[j]) : 0.0f;
  return local_tree<VEC>(a, P);
}

// The gated norm's per-element arithmetic (spec/gated.py), shared by the
// register, streaming and pipelined kernels. hf: the transformers convention
// (xhat rounded to the input dtype before the weight; the product rounded too
// when the weight has the input dtype); otherwise vLLM's (all fp32).
template <typename T>
__device__ __forceinline__ float gated_weighted(float xhat, float w, bool hf, bool w_in) {
  if (!hf) return mul(xhat, w);
  const float u = mul(DevIO<T>::rt(xhat), w);
  return w_in ? DevIO<T>::rt(u) : u;
}

// The output of one element, given act(z).
template <typename T>
__device__ __forceinline__ float gated_forward_act(float xhat, float w, float act, bool hf,
                                                   bool w_in) {
  return mul(gated_weighted<T>(xhat, w, hf, w_in), act);
}

template <typename T>
__device__ __forceinline__ float gated_forward_elem(float xhat, float w, float z, bool hf,
                                                    bool w_in, bool sig) {
  return gated_forward_act<T>(xhat, w, act_fp32(z, sig), hf, w_in);
}

// dgate, dxhat and the dweight contribution of one element.
struct GatedGrad {
  float dg, dxh, contrib;
};

// dgate, dxhat and the dweight contribution, given act(z) and act'(z).
template <typename T>
__device__ __forceinline__ GatedGrad gated_backward_act(float xhat, float w, Act a, float dy,
                                                        bool hf, bool w_in) {
  const float t = hf ? DevIO<T>::rt(xhat) : xhat;
  GatedGrad out;
  out.dg = mul(mul(dy, gated_weighted<T>(xhat, w, hf, w_in)), a.da);
  float du = mul(dy, a.a);
  if (hf) {
    if (w_in) du = DevIO<T>::rt(du);
    out.dxh = DevIO<T>::rt(mul(du, w));
  } else {
    out.dxh = mul(du, w);
  }
  out.contrib = mul(du, t);
  return out;
}

template <typename T>
__device__ __forceinline__ GatedGrad gated_backward_elem(float xhat, float w, float z, float dy,
                                                         bool hf, bool w_in, bool sig) {
  return gated_backward_act<T>(xhat, w, act_and_grad_fp32(z, sig), dy, hf, w_in);
}

// Forward outputs for VEC elements of one row.
template <int OP, typename T, int VEC>
__device__ __forceinline__ void write_forward(const float (&v)[VEC], float rstd,
                                              const float* __restrict__ w,
                                              const T* __restrict__ gr, T* __restrict__ yr,
                                              T* __restrict__ y2r, long long col, long long H,
                                              bool aligned, float offset, int flags) {
  float wv[VEC], out[VEC];
  load_w<VEC>(w, col, H, aligned, wv);
  if constexpr (OP == OP_GATED) {
    float z[VEC];
    load_vec<T, VEC>(gr, col, H, aligned, z);
    const bool hf = flags & F_HF, sig = flags & F_SIGMOID, w_in = flags & F_W_IS_INPUT;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      out[j] = gated_forward_elem<T>(mul(v[j], rstd), wv[j], z[j], hf, w_in, sig);
  } else {
    const bool use_off = flags & F_OFFSET;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      out[j] = mul(mul(v[j], rstd), scale_weight(wv[j], use_off, offset));
  }
  store_vec<T, VEC>(yr, col, H, aligned, out);
  if constexpr (OP == OP_FUSED) store_vec<T, VEC>(y2r, col, H, aligned, v);
}

// Backward, first half for VEC elements: dxhat (kept for the second half),
// the dweight contribution, dgate (stored) and the summand dxhat * xhat.
template <int OP, typename T, int VEC>
__device__ __forceinline__ float backward_first(const float (&v)[VEC], float rstd,
                                                const float* __restrict__ w,
                                                const T* __restrict__ gr,
                                                const T* __restrict__ dyr, T* __restrict__ d2r,
                                                long long col, long long H, long long P,
                                                bool aligned, float offset, int flags,
                                                float (&dxh)[VEC], float (&contrib)[VEC]) {
  float wv[VEC], dy[VEC], prod[VEC];
  load_w<VEC>(w, col, H, aligned, wv);
  load_vec<T, VEC>(dyr, col, H, aligned, dy);
  if constexpr (OP == OP_GATED) {
    float z[VEC], dg[VEC];
    load_vec<T, VEC>(gr, col, H, aligned, z);
    const bool hf = flags & F_HF, sig = flags & F_SIGMOID, w_in = flags & F_W_IS_INPUT;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float xhat = mul(v[j], rstd);
      const GatedGrad gg = gated_backward_elem<T>(xhat, wv[j], z[j], dy[j], hf, w_in, sig);
      dg[j] = gg.dg;
      dxh[j] = gg.dxh;
      contrib[j] = (col + j < H) ? gg.contrib : 0.0f;
      prod[j] = (col + j < H) ? mul(dxh[j], xhat) : 0.0f;
    }
    store_vec<T, VEC>(d2r, col, H, aligned, dg);
  } else {
    const bool use_off = flags & F_OFFSET;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float xhat = mul(v[j], rstd);
      dxh[j] = mul(dy[j], scale_weight(wv[j], use_off, offset));
      contrib[j] = (col + j < H) ? mul(dy[j], xhat) : 0.0f;
      prod[j] = (col + j < H) ? mul(dxh[j], xhat) : 0.0f;
    }
  }
  return local_tree<VEC>(prod, P);
}

// Backward, second half: dx (and dresidual for the fused op).
template <int OP, typename T, int VEC>
__device__ __forceinline__ void backward_second(const float (&v)[VEC], const float (&dxh)[VEC],
                                                float rstd, float m,
                                                const T* __restrict__ dresr, T* __restrict__ dxr,
                                                T* __restrict__ d2r, long long col, long long H,
                                                bool aligned, int flags) {
  float out[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) out[j] = mul(rstd, sub(dxh[j], mul(mul(v[j], rstd), m)));
  if constexpr (op_adds_dres(OP)) {
    float dres[VEC];
    load_vec<T, VEC>(dresr, col, H, aligned, dres);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float dsn = out[j];
      if (flags & F_ROUNDED) dsn = DevIO<T>::rt(dsn);
      out[j] = add(dsn, dres[j]);
    }
    if constexpr (OP == OP_FUSED) store_vec<T, VEC>(d2r, col, H, aligned, out);
  }
  store_vec<T, VEC>(dxr, col, H, aligned, out);
}

// Largest group size (log2) of rows a backward team reduces in registers.
template <int NP>
struct MaxGroupLog {
  static constexpr int value = NP == 1 ? 5 : (NP == 2 ? 3 : (NP == 4 ? 1 : 0));
};

}  // namespace normspec

// ---- kernels ------------------------------------------------------------------------
// Geometry (all kernels): blockDim.x = threads per team (a power of two,
// 32..1024); blockDim.y = teams per block (1 unless blockDim.x == 32).

// Forward, row held in registers: NP passes of blockDim.x * VEC elements
// (the host picks NP so that NP * blockDim.x * VEC >= H).
//   OP_RMS:   r, y2 unused.   OP_FUSED: r = residual, y2 = new residual.
//   OP_GATED: r = gate, y2 unused.
template <int OP, typename T, int NP>
__global__ void __launch_bounds__(1024)
    normspec_fwd_kernel(const T* __restrict__ x, const T* __restrict__ r,
                        const float* __restrict__ w, T* __restrict__ y, T* __restrict__ y2,
                        long long rows, long long H, long long sx, long long sr, long long sy,
                        long long sy2, float eps, float offset, int flags,
                        float* __restrict__ rstd_out = nullptr) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  __shared__ float red[2][NP * 32];
  const long long P = next_pow2(H);
  const long long S = static_cast<long long>(blockDim.x) * VEC;
  const bool aligned = flags & F_ALIGNED;
  const long long tcol = static_cast<long long>(threadIdx.x) * VEC;
  int buf = 0;
  for (long long row = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<long long>(gridDim.x) * blockDim.y) {
    const T* xr = x + row * sx;
    const T* rr = op_reads_second(OP) ? r + row * sr : nullptr;
    float v[NP][VEC];
    float part[NP];
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const long long col = p * S + tcol;
      if (col < H) {
        load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v[p]);
        part[p] = local_sum_sq<VEC>(v[p], col, H, P);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[p][j] = 0.0f;
        part[p] = 0.0f;
      }
    }
    team_reduce<NP, VEC>(part, P, red[buf]);
    buf ^= 1;
    const float rstd = rstd_from_ss(fold_passes<NP>(part, S, P), H, eps);
    if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
    T* yr = y + row * sy;
    T* y2r = (OP == OP_FUSED) ? y2 + row * sy2 : nullptr;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const long long col = p * S + tcol;
      if (col < H) write_forward<OP, T, VEC>(v[p], rstd, w, rr, yr, y2r, col, H, aligned, offset,
                                             flags);
    }
  }
}

// Forward for rows too long for registers: one block (1024 threads) per row,
// the row is read twice; passes are combined through a binary-counter stack.
template <int OP, typename T>
__global__ void __launch_bounds__(1024)
    normspec_fwd_stream_kernel(const T* __restrict__ x, const T* __restrict__ r,
                               const float* __restrict__ w, T* __restrict__ y,
                               T* __restrict__ y2, long long rows, long long H, long long sx,
                               long long sr, long long sy, long long sy2, float eps, float offset,
                               int flags, float* __restrict__ rstd_out = nullptr) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  __shared__ float red[2][32];
  const long long P = next_pow2(H);
  const long long S = static_cast<long long>(blockDim.x) * VEC;
  const long long npass = P > S ? P / S : 1;
  const bool aligned = flags & F_ALIGNED;
  const long long tcol = static_cast<long long>(threadIdx.x) * VEC;
  int buf = 0;
  float stk[64];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * sx;
    const T* rr = op_reads_second(OP) ? r + row * sr : nullptr;
    float total = 0.0f;
    for (long long j = 0; j < npass; ++j) {
      float part[1] = {0.0f};
      if (j * S < H) {  // uniform over the block
        const long long col = j * S + tcol;
        float v[VEC];
        load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v);
        part[0] = local_sum_sq<VEC>(v, col, H, P);
        team_reduce<1, VEC>(part, P, red[buf]);
        buf ^= 1;
      }
      total = stack_push(stk, j, part[0]);
    }
    const float rstd = rstd_from_ss(total, H, eps);
    if (rstd_out != nullptr && threadIdx.x == 0) rstd_out[row] = rstd;
    T* yr = y + row * sy;
    T* y2r = (OP == OP_FUSED) ? y2 + row * sy2 : nullptr;
    for (long long col = tcol; col < H; col += S) {
      float v[VEC];
      load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v);
      write_forward<OP, T, VEC>(v, rstd, w, rr, yr, y2r, col, H, aligned, offset, flags);
    }
  }
}

// Backward, rows held in registers (teams of at most 256 threads, so that the
// per-column stacks stay in registers). A team reduces the dweight contributions
// of groups of R = 2**glog consecutive rows (glog <= MaxGroupLog<NP>) and
// writes one fp32 row per group: ws[g * H + col], g < ceil(rows / R).
//   OP_RMS:   r, dres, d2 unused.
//   OP_FUSED: r = residual, dres = gradient of the new residual, d2 = dresidual.
//   OP_FUSED_SUM: x = the sum s, dres as OP_FUSED; r, d2 unused (dx is ds).
//   OP_GATED: r = gate, dres unused, d2 = dgate.
template <int OP, typename T, int NP>
__global__ void __launch_bounds__(256)
    normspec_bwd_kernel(const T* __restrict__ x, const T* __restrict__ r,
                        const float* __restrict__ w, const T* __restrict__ dy,
                        const T* __restrict__ dres, T* __restrict__ dx, T* __restrict__ d2,
                        float* __restrict__ ws, long long rows, long long H, long long sx,
                        long long sr, long long sdy, long long sdres, long long sdx,
                        long long sd2, float eps, float offset, int flags, int glog) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  constexpr int ML = MaxGroupLog<NP>::value;
  __shared__ float red[2][NP * 32];
  const long long P = next_pow2(H);
  const long long S = static_cast<long long>(blockDim.x) * VEC;
  const bool aligned = flags & F_ALIGNED;
  const bool ws_aligned = (H % 4) == 0;
  const long long tcol = static_cast<long long>(threadIdx.x) * VEC;
  const long long R = 1LL << glog;
  const long long groups = (rows + R - 1) >> glog;  // a shift: no 64-bit division
  int buf = 0;
  for (long long g = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; g < groups;
       g += static_cast<long long>(gridDim.x) * blockDim.y) {
    float stk[ML > 0 ? ML : 1][NP][VEC];
    float acc[NP][VEC];
    for (long long j = 0; j < R; ++j) {
      const long long row = g * R + j;
      float contrib[NP][VEC];
      if (row < rows) {  // uniform over the team
        const T* xr = x + row * sx;
        const T* rr = op_reads_second(OP) ? r + row * sr : nullptr;
        float v[NP][VEC];
        float part[NP];
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          const long long col = p * S + tcol;
          if (col < H) {
            load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v[p]);
            part[p] = local_sum_sq<VEC>(v[p], col, H, P);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[p][k] = 0.0f;
            part[p] = 0.0f;
          }
        }
        team_reduce<NP, VEC>(part, P, red[buf]);
        buf ^= 1;
        const float rstd = rstd_from_ss(fold_passes<NP>(part, S, P), H, eps);
        const T* dyr = dy + row * sdy;
        T* d2r = op_writes_second(OP) ? d2 + row * sd2 : nullptr;
        float dxh[NP][VEC];
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          const long long col = p * S + tcol;
          if (col < H) {
            part[p] = backward_first<OP, T, VEC>(v[p], rstd, w, rr, dyr, d2r, col, H, P, aligned,
                                                 offset, flags, dxh[p], contrib[p]);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              dxh[p][k] = 0.0f;
              contrib[p][k] = 0.0f;
            }
            part[p] = 0.0f;
          }
        }
        team_reduce<NP, VEC>(part, P, red[buf]);
        buf ^= 1;
        const float m = div_by_count(fold_passes<NP>(part, S, P), H);
        const T* dresr = op_adds_dres(OP) ? dres + row * sdres : nullptr;
        T* dxr = dx + row * sdx;
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          const long long col = p * S + tcol;
          if (col < H) backward_second<OP, T, VEC>(v[p], dxh[p], rstd, m, dresr, dxr, d2r, col, H,
                                                   aligned, flags);
        }
      } else {
#pragma unroll
        for (int p = 0; p < NP; ++p)
#pragma unroll
          for (int k = 0; k < VEC; ++k) contrib[p][k] = 0.0f;
      }
      // push this row's contributions onto the per-column stacks
#pragma unroll
      for (int p = 0; p < NP; ++p) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          float cur = contrib[p][k];
          bool done = false;
#pragma unroll
          for (int l = 0; l < ML; ++l) {
            if (!done && l < glog) {
              if ((j >> l) & 1) {
                cur = add(stk[l][p][k], cur);
              } else {
                stk[l][p][k] = cur;
                done = true;
              }
            }
          }
          acc[p][k] = cur;
        }
      }
    }
    float* wsr = ws + g * H;
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const long long col = p * S + tcol;
      if (col < H) store_vec<float, VEC>(wsr, col, H, ws_aligned, acc[p]);
    }
  }
}

// Backward for rows too long for registers: one block per row, three passes
// over the row; the dweight contributions are written per row (ws row = row).
template <int OP, typename T>
__global__ void __launch_bounds__(1024)
    normspec_bwd_stream_kernel(const T* __restrict__ x, const T* __restrict__ r,
                               const float* __restrict__ w, const T* __restrict__ dy,
                               const T* __restrict__ dres, T* __restrict__ dx,
                               T* __restrict__ d2, float* __restrict__ ws, long long rows,
                               long long H, long long sx, long long sr, long long sdy,
                               long long sdres, long long sdx, long long sd2, float eps,
                               float offset, int flags) {
  using namespace normspec;
  constexpr int VEC = VecOf<T>::value;
  __shared__ float red[2][32];
  const long long P = next_pow2(H);
  const long long S = static_cast<long long>(blockDim.x) * VEC;
  const long long npass = P > S ? P / S : 1;
  const bool aligned = flags & F_ALIGNED;
  const bool ws_aligned = (H % 4) == 0;
  const long long tcol = static_cast<long long>(threadIdx.x) * VEC;
  int buf = 0;
  float stk[64];
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * sx;
    const T* rr = op_reads_second(OP) ? r + row * sr : nullptr;
    const T* dyr = dy + row * sdy;
    T* d2r = op_writes_second(OP) ? d2 + row * sd2 : nullptr;
    float* wsr = ws + row * H;
    float total = 0.0f;
    for (long long j = 0; j < npass; ++j) {
      float part[1] = {0.0f};
      if (j * S < H) {
        const long long col = j * S + tcol;
        float v[VEC];
        load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v);
        part[0] = local_sum_sq<VEC>(v, col, H, P);
        team_reduce<1, VEC>(part, P, red[buf]);
        buf ^= 1;
      }
      total = stack_push(stk, j, part[0]);
    }
    const float rstd = rstd_from_ss(total, H, eps);
    for (long long j = 0; j < npass; ++j) {
      float part[1] = {0.0f};
      if (j * S < H) {
        const long long col = j * S + tcol;
        float v[VEC], dxh[VEC], contrib[VEC];
        load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v);
        if (col < H) {
          part[0] = backward_first<OP, T, VEC>(v, rstd, w, rr, dyr, d2r, col, H, P, aligned,
                                               offset, flags, dxh, contrib);
          store_vec<float, VEC>(wsr, col, H, ws_aligned, contrib);
        }
        team_reduce<1, VEC>(part, P, red[buf]);
        buf ^= 1;
      }
      total = stack_push(stk, j, part[0]);
    }
    const float m = div_by_count(total, H);
    const T* dresr = op_adds_dres(OP) ? dres + row * sdres : nullptr;
    T* dxr = dx + row * sdx;
    for (long long col = tcol; col < H; col += S) {
      float v[VEC], dxh[VEC], contrib[VEC];
      load_norm_input<OP, T, VEC>(xr, rr, col, H, aligned, flags, v);
      // recompute dxhat (identical bits); the d2 store of the gated op repeats
      // the same values
      backward_first<OP, T, VEC>(v, rstd, w, rr, dyr, d2r, col, H, P, aligned, offset, flags,
                                 dxh, contrib);
      backward_second<OP, T, VEC>(v, dxh, rstd, m, dresr, dxr, d2r, col, H, aligned, flags);
    }
  }
}

#ifndef NORMSPEC_NO_COL_TREE  // defined by the launch units: normspec_launch.cu alone has it
namespace normspec {
// v[0] = the pairwise tree of v[0 .. C), C a power of two <= 16 (the others unused).
__device__ __forceinline__ void fold_rows(float (&v)[16], long long C) {
#pragma unroll
  for (int s = 16; s > 1; s >>= 1) {
    if (s <= C) {
#pragma unroll
      for (int i = 0; i < s / 2; ++i) v[i] = add(v[2 * i], v[2 * i + 1]);
    }
  }
}
}  // namespace normspec

// One level of the dweight row tree: out[o] = tree of in[o*C .. o*C + C)
// (rows beyond G are +0.0 padding), C = 2**clog <= 16, o < ceil(G / C).
// blockDim.x threads over columns, grid (ceil(H / blockDim.x), any).
__global__ void __launch_bounds__(256)
    normspec_col_tree_kernel(const float* __restrict__ in, float* __restrict__ out,
                             long long G, long long H, int clog) {
  using namespace normspec;
  constexpr int CMAX = 16;
  let_dependents_launch();  // the next level or the last fold waits for this grid
  wait_for_previous_grid();
  const long long col = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= H) return;
  const long long C = 1LL << clog;
  const long long gout = (G + C - 1) / C;
  for (long long o = blockIdx.y; o < gout; o += gridDim.y) {
    float v[CMAX];
#pragma unroll
    for (int i = 0; i < CMAX; ++i) {
      const long long gi = o * C + i;
      v[i] = (i < C && gi < G) ? in[gi * H + col] : 0.0f;
    }
    fold_rows(v, C);
    out[o * H + col] = v[0];
  }
}

// The last two levels of the dweight row tree and the cast to the weight's dtype in
// one launch, for G <= 256 rows: out[col] = TW(tree of in[0 .. G) with
// +0.0 padding to P = next_pow2(G)). The adds are the ones normspec_col_tree_kernel
// would do, in the same order, run until one row is left: row threadIdx.y = s folds
// rows [s * C1, s * C1 + C1) with C1 = 2**clog1 = min(16, P), as the first level
// would, and one thread per column folds the P / C1 = 2**slog partials, as the next
// level would. The cast rounds to nearest even, as torch's .to() does. Launches
// (16, 16) threads on ceil(H / 16) blocks (normspec::launch_col_tree_last).
template <typename TW>
__global__ void __launch_bounds__(256)
    normspec_col_tree_last_kernel(const float* __restrict__ in, TW* __restrict__ out,
                                  long long G, long long H, int clog1, int slog) {
  using namespace normspec;
  constexpr int CMAX = 16;
  __shared__ float partial[CMAX][CMAX + 1];
  wait_for_previous_grid();
  const long long col = static_cast<long long>(blockIdx.x) * CMAX + threadIdx.x;
  const int C1 = 1 << clog1;
  const int nseg = 1 << slog;
  float v[CMAX];
  if (static_cast<int>(threadIdx.y) < nseg) {
#pragma unroll
    for (int i = 0; i < CMAX; ++i) {
      const long long gi = static_cast<long long>(threadIdx.y) * C1 + i;
      v[i] = (col < H && i < C1 && gi < G) ? in[gi * H + col] : 0.0f;
    }
    fold_rows(v, C1);
    partial[threadIdx.y][threadIdx.x] = v[0];
  }
  __syncthreads();
  if (threadIdx.y != 0 || col >= H) return;
#pragma unroll
  for (int i = 0; i < CMAX; ++i) v[i] = i < nseg ? partial[i][threadIdx.x] : 0.0f;
  fold_rows(v, nseg);
  if constexpr (sizeof(TW) == 4) {
    out[col] = v[0];
  } else {
    reinterpret_cast<unsigned short*>(out)[col] =
        static_cast<unsigned short>(DevIO<TW>::to_bits(v[0]));
  }
}
#endif  // NORMSPEC_NO_COL_TREE
