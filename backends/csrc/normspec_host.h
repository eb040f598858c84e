// Torch-facing helpers shared by the CPU (.cpp) and CUDA (.cu) operator
// implementations: argument checks and the (rows, H) view of an input.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>

#include "normspec_arith.h"

namespace normspec {

// A (..., H) tensor seen as rows of H elements with a row stride (in elements).
// The last dimension must be contiguous and the leading dimensions must
// collapse into one stride; otherwise a contiguous copy is taken (the results
// are bitwise identical either way).
struct RowView {
  at::Tensor t;        // the tensor whose storage is read (maybe a copy)
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t stride = 0;  // row stride in elements
};

inline bool collapsible_rows(const at::Tensor& t, int64_t* row_stride) {
  const int64_t nd = t.dim();
  const int64_t hidden = t.size(nd - 1);
  if (hidden != 1 && t.stride(nd - 1) != 1) return false;
  int64_t rs = -1, expect = -1;
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (rs < 0) {
      rs = t.stride(d);
      expect = t.stride(d) * t.size(d);
    } else if (t.stride(d) != expect) {
      return false;
    } else {
      expect = t.stride(d) * t.size(d);
    }
  }
  *row_stride = rs < 0 ? hidden : rs;
  return true;
}

inline RowView row_view(const at::Tensor& t) {
  RowView v;
  v.hidden = t.size(-1);
  v.rows = v.hidden > 0 ? t.numel() / v.hidden : 0;
  int64_t rs = 0;
  if (collapsible_rows(t, &rs)) {
    v.t = t;
    v.stride = rs;
  } else {
    v.t = t.contiguous();
    v.stride = v.hidden;
  }
  return v;
}

inline void check_input(const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              name, ": expected dtype in (float32, bfloat16, float16), got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, name,
              ": expected shape (..., H) with H >= 1, got ", x.sizes());
}

inline void check_like(const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.sizes() == x.sizes(), name, ": expected the shape of x, ", x.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), name, ": expected the dtype of x, ",
              x.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == x.device(), name, ": expected the device of x, ", x.device(),
              ", got ", t.device());
}

inline void check_weight(const at::Tensor& w, const at::Tensor& x) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "weight: expected shape (", x.size(-1),
              ",) to match x's last dimension, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == x.scalar_type(),
              "weight: expected dtype float32 or x's dtype (", x.scalar_type(), "), got ",
              w.scalar_type());
  TORCH_CHECK(w.device() == x.device(), "weight: expected the device of x, ", x.device(),
              ", got ", w.device());
}

inline void check_eps(double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "eps: expected a finite value > 0, got ", eps);
}

inline void check_offset(double offset) {
  TORCH_CHECK(std::isfinite(offset), "offset: expected a finite value, got ", offset);
}

inline bool parse_residual_sum(c10::string_view s) {
  if (s == "fp32") return false;
  if (s == "rounded") return true;
  TORCH_CHECK(false, "residual_sum: expected one of ('fp32', 'rounded'), got '", std::string(s),
              "'");
  return false;
}

// The residual_sum of a backward given the sum s the norm read: "rounded", or "fp32"
// for float32 rows only (a 16-bit "fp32" norm reads the unrounded sum, which the
// new residual does not hold).
inline bool parse_sum_convention(c10::string_view residual_sum, const at::Tensor& s) {
  const bool rounded = parse_residual_sum(residual_sum);
  TORCH_CHECK(rounded || s.scalar_type() == at::kFloat,
              "residual_sum: the backward from the saved sum needs 'rounded' or float32 rows "
              "(the norm of 'fp32' reads the unrounded sum), got 'fp32' with s of dtype ",
              s.scalar_type());
  return rounded;
}

inline bool parse_convention_hf(c10::string_view s) {
  if (s == "vllm") return false;
  if (s == "hf") return true;
  TORCH_CHECK(false, "convention: expected one of ('vllm', 'hf'), got '", std::string(s), "'");
  return false;
}

inline bool parse_activation_sigmoid(c10::string_view s) {
  if (s == "silu") return false;
  if (s == "sigmoid") return true;
  TORCH_CHECK(false, "activation: expected one of ('silu', 'sigmoid'), got '", std::string(s),
              "'");
  return false;
}

// The checks every operator starts with, shared by the CPU and CUDA entry
// points (in this order, so both report the same first error): x, the other
// row tensors (named as in the schema; each like x), the weight, eps and,
// for the operators that take one, the offset.
struct NamedRows {
  const char* name;
  const at::Tensor& t;
};

inline void check_rows_weight_eps(const at::Tensor& x, std::initializer_list<NamedRows> rows,
                                  const at::Tensor& weight, double eps) {
  check_input("x", x);
  for (const NamedRows& r : rows) check_like(r.name, r.t, x);
  check_weight(weight, x);
  check_eps(eps);
}

inline void check_norm_args(const at::Tensor& x, std::initializer_list<NamedRows> rows,
                            const at::Tensor& weight, double eps, double offset) {
  check_rows_weight_eps(x, rows, weight, eps);
  check_offset(offset);
}

// The gated operators' flag bits from their string options (checked).
inline int gated_flags(c10::string_view convention, c10::string_view activation) {
  return (parse_convention_hf(convention) ? F_HF : 0) |
         (parse_activation_sigmoid(activation) ? F_SIGMOID : 0);
}

// The fp32 weight the kernels read (exact conversion, contiguous).
inline at::Tensor weight_f32(const at::Tensor& w) { return w.to(at::kFloat).contiguous(); }

// Flags from the operator options.
inline int rms_flags(double offset) { return offset != 0.0 ? F_OFFSET : 0; }

// rstd of every row as the *_with_rstd forwards return it: fp32, the shape of
// x without its last dimension (the spec's bits; 4 bytes a row).
inline at::Tensor new_rstd(const at::Tensor& x) {
  return at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
}
// new_rstd(x) when `with_rstd`, else an undefined tensor.
inline at::Tensor rstd_if(bool with_rstd, const at::Tensor& x) {
  return with_rstd ? new_rstd(x) : at::Tensor();
}
// Where a forward writes rstd: nullptr when not wanted (or no rows).
inline float* rstd_ptr(const at::Tensor& rstd) {
  return rstd.defined() && rstd.numel() > 0 ? rstd.data_ptr<float>() : nullptr;
}

// The rstd a backward operator was given (nullptr: none, recompute it): fp32,
// contiguous, one value per row of x, on x's device.
inline const float* given_rstd(const c10::optional<at::Tensor>& rstd, const at::Tensor& x) {
  if (!rstd.has_value() || !rstd->defined()) return nullptr;
  const at::Tensor& r = *rstd;
  TORCH_CHECK(r.scalar_type() == at::kFloat, "rstd: expected dtype float32, got ",
              r.scalar_type());
  TORCH_CHECK(r.sizes() == x.sizes().slice(0, x.dim() - 1),
              "rstd: expected the shape of x without its last dimension, ",
              x.sizes().slice(0, x.dim() - 1), ", got ", r.sizes());
  TORCH_CHECK(r.is_contiguous(), "rstd: expected a contiguous tensor");
  TORCH_CHECK(r.device() == x.device(), "rstd: expected the device of x, ", x.device(),
              ", got ", r.device());
  return r.data_ptr<float>();
}

}  // namespace normspec
