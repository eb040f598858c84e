// normspec declared arithmetic, shared by the host C++ kernels and the CUDA
// kernels (nvcc and NVRTC). Every function is a fixed sequence of correctly
// rounded IEEE-754 fp32 operations, exactly the sequence of spec/arithmetic.py.
//
// * On the device every +, -, *, / and sqrt goes through an _rn intrinsic, so
//   no fused multiply-add can be formed whatever -fmad says (NVRTC defaults to
//   --fmad=true).
// * On the host the file must be compiled with -ffp-contract=off and without
//   -ffast-math; fp32 `/` is correctly rounded, sqrt is formed in double and
//   rounded once (exactly as the spec does).
// * No standard-library header is needed under NVRTC.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define NS_HD __host__ __device__ __forceinline__
#else
#define NS_HD inline
#endif

#if !defined(__CUDACC_RTC__)
#include <cmath>
#include <cstdint>
#include <cstring>
#endif

namespace normspec {

// ---- constants (fp32 bit patterns, see spec/arithmetic.py) -----------------
// LOG2E 0x3FB8AA3B, LN2_HI 0x3F317200, LN2_LO 0x35BFBE8E,
// 1/7! 0x39500D01, 1/6! 0x3AB60B61, 1/5! 0x3C088889, 1/4! 0x3D2AAAAB,
// 1/3! 0x3E2AAAAB, 1/2! 0x3F000000.
#define NS_LOG2E 0x1.715476p+0f
#define NS_LN2_HI 0x1.62e4p-1f
#define NS_LN2_LO 0x1.7f7d1cp-20f
#define NS_C7 0x1.a01a02p-13f
#define NS_C6 0x1.6c16c2p-10f
#define NS_C5 0x1.111112p-7f
#define NS_C4 0x1.555556p-5f
#define NS_C3 0x1.555556p-3f
#define NS_C2 0x1.0p-1f

// ---- correctly rounded fp32 primitives --------------------------------------
NS_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
NS_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
NS_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
NS_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
NS_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return static_cast<float>(std::sqrt(static_cast<double>(a)));
#endif
}
// a / n for a row length n, formed in double and rounded once: equal to the
// correctly rounded fp32 quotient whenever n is exact in fp32, and equal to
// the spec's float64 formula for every n.
//
// On the device a power-of-two n (every hidden size the models use) takes a
// shortcut with the same result: a / 2**k is exact in double (no double
// underflow for k <= 62), so rounding it to fp32 is the correctly rounded
// product a * 2**-k, which is what __fmul_rn gives (2**-k is a normal fp32).
NS_HD float pow2i(int e);
NS_HD float div_by_count(float a, long long n) {
#if defined(__CUDA_ARCH__)
  if (n > 0 && (n & (n - 1)) == 0) return __fmul_rn(a, pow2i(1 - __ffsll(n)));
  return __double2float_rn(__ddiv_rn(static_cast<double>(a), static_cast<double>(n)));
#else
  return static_cast<float>(static_cast<double>(a) / static_cast<double>(n));
#endif
}
NS_HD bool is_nan(float a) { return a != a; }
NS_HD float rint_even(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::nearbyint(a);  // default rounding mode: to nearest, ties to even
#endif
}
NS_HD float bits_to_float(int bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// 2**e for e in [-126, 127], built from the exponent bits.
NS_HD float pow2i(int e) { return bits_to_float((e + 127) << 23); }

// ---- declared transcendental functions ------------------------------------
// exp_fp32 of spec/arithmetic.py, step for step.
NS_HD float exp_fp32(float z) {
  if (is_nan(z)) return z;
  float zc = z < -110.0f ? -110.0f : (z > 100.0f ? 100.0f : z);
  float n = rint_even(mul(zc, NS_LOG2E));
  float r = sub(sub(zc, mul(n, NS_LN2_HI)), mul(n, NS_LN2_LO));
  float p = NS_C7;
  p = add(mul(p, r), NS_C6);
  p = add(mul(p, r), NS_C5);
  p = add(mul(p, r), NS_C4);
  p = add(mul(p, r), NS_C3);
  p = add(mul(p, r), NS_C2);
  p = add(mul(p, r), 1.0f);
  p = add(mul(p, r), 1.0f);
  int ni = static_cast<int>(n);
  int a = ni >> 1;  // floor(n / 2): arithmetic shift
  int b = ni - a;
  return mul(mul(p, pow2i(a)), pow2i(b));
}

// The gate's activation and its derivative from one exp_fp32(-z).
struct Act {
  float a;   // act(z)
  float da;  // act'(z)
};

// sigmoid(z) = 1 / (1 + exp(-z)); sigmoid' = s (1 - s)
// silu(z) = z / (1 + exp(-z));    silu' = s (1 + z (1 - s))
NS_HD float sigmoid_fp32(float z) { return div(1.0f, add(1.0f, exp_fp32(-z))); }
NS_HD float silu_fp32(float z) { return div(z, add(1.0f, exp_fp32(-z))); }
NS_HD float act_fp32(float z, bool sigmoid) {
  float d = add(1.0f, exp_fp32(-z));
  return div(sigmoid ? 1.0f : z, d);
}
NS_HD Act act_and_grad_fp32(float z, bool sigmoid) {
  float d = add(1.0f, exp_fp32(-z));
  float s = div(1.0f, d);
  Act out;
  if (sigmoid) {
    out.a = s;
    out.da = mul(s, sub(1.0f, s));
  } else {
    out.a = div(z, d);
    out.da = mul(s, add(1.0f, mul(z, sub(1.0f, s))));
  }
  return out;
}

// ---- the norm's scalar steps ------------------------------------------------
// rstd = 1 / sqrt(ss / H + eps32): four correctly rounded fp32 steps.
NS_HD float rstd_from_ss(float ss, long long hidden, float eps32) {
  float mean = div_by_count(ss, hidden);
  float v = add(mean, eps32);
  return div(1.0f, sqrt_rn(v));
}

// The weight factor g: w as is when offset == 0 (a -0.0 weight stays -0.0),
// otherwise fp32(offset) + w.
NS_HD float scale_weight(float w, bool use_offset, float offset32) {
  return use_offset ? add(offset32, w) : w;
}

// Smallest power of two >= n (1 for n <= 1).
NS_HD long long next_pow2(long long n) {
  long long p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Slots of the gate table (normspec_pipe.cuh), shared with the launch plan.
constexpr int GATE_TABLE_SLOTS = 8192;

// Operator codes shared by the launchers.
// OP_FUSED_SUM is the fused op's backward given the sum s the norm read (the
// forward's new residual where that is s: residual_sum "rounded", or fp32 rows):
// x = s, no residual row, and one gradient row ds (= dx = dresidual) is written.
enum OpCode : int { OP_RMS = 0, OP_FUSED = 1, OP_GATED = 2, OP_FUSED_SUM = 3 };

// Whether the op reads a second row tensor (the residual or the gate).
NS_HD constexpr bool op_reads_second(int op) { return op == OP_FUSED || op == OP_GATED; }
// Whether the op's backward adds the new residual's gradient (dres) to the norm's.
NS_HD constexpr bool op_adds_dres(int op) { return op == OP_FUSED || op == OP_FUSED_SUM; }
// Whether the op's backward writes a second gradient row (dresidual or dgate).
NS_HD constexpr bool op_writes_second(int op) { return op == OP_FUSED || op == OP_GATED; }

// Flag bits passed to the kernels (and used by the host kernels).
enum Flags : int {
  F_OFFSET = 1,       // add fp32(offset) to the weight
  F_ROUNDED = 2,      // fused: residual_sum == "rounded"
  F_HF = 4,           // gated: convention == "hf"
  F_SIGMOID = 8,      // gated: activation == "sigmoid"
  F_W_IS_INPUT = 16,  // the weight's dtype is the input dtype (hf: promoted dtype = input)
  F_ALIGNED = 32,     // every row pointer is 16-byte aligned: vector loads allowed
  F_GATE_TABLE = 64,  // gated bf16, pipelined kernels: activation table in shared memory
  F_W_RAW = 128,      // pipelined kernels, 16-bit inputs: the weight pointer holds the
                      // input dtype (widened exactly), not fp32
  F_DW_FINAL = 256,   // pipelined backward, one dweight group: its tree is dweight, stored
                      // rounded to the input dtype at ws (which holds H of them)
  F_LET_DEPENDENTS = 512,  // pipelined backward: chained tree launches follow; let them
                           // start early (griddepcontrol.launch_dependents)
};

}  // namespace normspec
