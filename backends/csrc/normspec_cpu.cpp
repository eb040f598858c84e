// CPU kernels of the normspec operators: bitwise equal to spec/ (compile with
// -ffp-contract=off, never with -ffast-math).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "normspec_arith.h"
#include "normspec_host.h"

namespace normspec {
namespace {

template <typename T>
struct HostIO {
  static float load(T v) { return static_cast<float>(v); }
  static T store(float v) { return static_cast<T>(v); }  // round to nearest even
  static float rt(float v) { return static_cast<float>(static_cast<T>(v)); }
};

// Pairwise tree over buf[0, P) (P a power of two, already zero-padded).
inline float tree_fold(float* buf, int64_t P) {
  for (int64_t len = P; len > 1; len >>= 1) {
    const int64_t half = len >> 1;
    for (int64_t i = 0; i < half; ++i) buf[i] = add(buf[2 * i], buf[2 * i + 1]);
  }
  return buf[0];
}

inline int64_t grain_rows(int64_t hidden) { return std::max<int64_t>(1, 16384 / hidden); }

struct Opts {
  int op = OP_RMS;
  int flags = 0;
  float eps32 = 0.f;
  float offset32 = 0.f;
};

// The fp32 value the norm reads: x, or the residual sum (rounded on request).
template <typename T>
inline float norm_input(const Opts& o, const T* xr, const T* rr, int64_t i) {
  using IO = HostIO<T>;
  float v = IO::load(xr[i]);
  if (o.op == OP_FUSED) {
    v = add(v, IO::load(rr[i]));
    if (o.flags & F_ROUNDED) v = IO::rt(v);
  }
  return v;
}

template <typename T>
void forward_impl(const Opts& o, const RowView& xv, const RowView* rv, const float* w, T* y,
                  T* y2, float* rstd_out) {
  using IO = HostIO<T>;
  const int64_t H = xv.hidden, rows = xv.rows, P = next_pow2(H);
  const T* x = xv.t.data_ptr<T>();
  const T* r = rv ? rv->t.data_ptr<T>() : nullptr;
  const int64_t sr = rv ? rv->stride : 0;
  const bool use_off = o.flags & F_OFFSET, hf = o.flags & F_HF, sig = o.flags & F_SIGMOID,
             w_in = o.flags & F_W_IS_INPUT;
  std::vector<float> g(H);
  for (int64_t i = 0; i < H; ++i) g[i] = scale_weight(w[i], use_off, o.offset32);
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> s(H), buf(P);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * xv.stride;
      const T* rr = r ? r + row * sr : nullptr;
      for (int64_t i = 0; i < H; ++i) {
        s[i] = norm_input(o, xr, rr, i);
        buf[i] = mul(s[i], s[i]);
      }
      std::fill(buf.begin() + H, buf.end(), 0.0f);
      const float rstd = rstd_from_ss(tree_fold(buf.data(), P), H, o.eps32);
      if (rstd_out != nullptr) rstd_out[row] = rstd;
      T* yr = y + row * H;
      if (o.op == OP_GATED) {
        for (int64_t i = 0; i < H; ++i) {
          const float xhat = mul(s[i], rstd);
          float u;
          if (hf) {
            u = mul(IO::rt(xhat), w[i]);
            if (w_in) u = IO::rt(u);
          } else {
            u = mul(xhat, w[i]);
          }
          yr[i] = IO::store(mul(u, act_fp32(IO::load(rr[i]), sig)));
        }
      } else {
        for (int64_t i = 0; i < H; ++i) yr[i] = IO::store(mul(mul(s[i], rstd), g[i]));
        if (o.op == OP_FUSED) {
          T* y2r = y2 + row * H;
          for (int64_t i = 0; i < H; ++i) y2r[i] = IO::store(s[i]);
        }
      }
    }
  });
}

// Row tree over contrib (rows, H) in flattened row order, zero-padded to a
// power of two: the ceil-halving fold adds the +0.0 padding literally.
at::Tensor row_tree(at::Tensor contrib) {
  int64_t len = contrib.size(0);
  const int64_t H = contrib.size(1);
  if (len == 0) return at::zeros({H}, contrib.options());
  while (len > 1) {
    const int64_t half = (len + 1) / 2;
    at::Tensor next = at::empty({half, H}, contrib.options());
    const float* src = contrib.data_ptr<float>();
    float* dst = next.data_ptr<float>();
    const int64_t n = len;
    at::parallel_for(0, half, grain_rows(H), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* a = src + (2 * i) * H;
        float* d = dst + i * H;
        if (2 * i + 1 < n) {
          const float* c = a + H;
          for (int64_t k = 0; k < H; ++k) d[k] = add(a[k], c[k]);
        } else {
          for (int64_t k = 0; k < H; ++k) d[k] = add(a[k], 0.0f);
        }
      }
    });
    contrib = next;
    len = half;
  }
  return contrib.reshape({H});
}

// Rows per block of the backward's dweight contributions: a power of two with at most
// kBlockElements fp32 values (4 MiB), and no more than the padded row count, as the
// spec's blocks (spec/blocks.py): the row tree splits into block trees (the last block
// zero-padded) and a tree over the blocks, the same additions as one tree over the rows.
constexpr int64_t kBlockElements = int64_t(1) << 20;

inline int64_t block_rows(int64_t rows, int64_t hidden) {
  int64_t limit = std::max<int64_t>(1, kBlockElements / std::max<int64_t>(1, hidden));
  int64_t b = 1;
  while (b * 2 <= limit) b *= 2;
  return std::min<int64_t>(b, next_pow2(rows));
}

// Backward: writes dx (and d2 = dresidual or dgate) and returns dweight in fp32 (H), the
// row tree of the per-row contributions, formed block by block.
template <typename T>
at::Tensor backward_impl(const Opts& o, const RowView& dyv, const RowView& xv, const RowView* rv,
                         const RowView* dresv, const float* w, T* dx, T* d2,
                         const float* rstd_in) {
  using IO = HostIO<T>;
  const int64_t H = xv.hidden, rows = xv.rows, P = next_pow2(H);
  const int64_t block = block_rows(rows, H);
  at::Tensor contrib = at::empty({block, H}, xv.t.options().dtype(at::kFloat));
  float* cb = contrib.data_ptr<float>();
  std::vector<at::Tensor> partials;
  const T* x = xv.t.data_ptr<T>();
  const T* dy = dyv.t.data_ptr<T>();
  const T* r = rv ? rv->t.data_ptr<T>() : nullptr;
  const T* dres = dresv ? dresv->t.data_ptr<T>() : nullptr;
  const int64_t sr = rv ? rv->stride : 0;
  const bool use_off = o.flags & F_OFFSET, hf = o.flags & F_HF, sig = o.flags & F_SIGMOID,
             w_in = o.flags & F_W_IS_INPUT, rounded = o.flags & F_ROUNDED;
  std::vector<float> g(H);
  for (int64_t i = 0; i < H; ++i) g[i] = scale_weight(w[i], use_off, o.offset32);
  for (int64_t first = 0; first < rows; first += block) {
  const int64_t n = std::min(block, rows - first);
  at::parallel_for(first, first + n, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> s(H), dxh(H), buf(P);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * xv.stride;
      const T* rr = r ? r + row * sr : nullptr;
      const T* dyr = dy + row * dyv.stride;
      for (int64_t i = 0; i < H; ++i) {
        s[i] = norm_input(o, xr, rr, i);
        buf[i] = mul(s[i], s[i]);
      }
      std::fill(buf.begin() + H, buf.end(), 0.0f);
      // the forward's rstd where given (the same bits), else the row's
      const float rstd =
          rstd_in != nullptr ? rstd_in[row] : rstd_from_ss(tree_fold(buf.data(), P), H, o.eps32);
      float* cr = cb + (row - first) * H;
      T* d2r = d2 ? d2 + row * H : nullptr;
      for (int64_t i = 0; i < H; ++i) {
        const float xhat = mul(s[i], rstd);
        const float dy32 = IO::load(dyr[i]);
        float dxhat;
        if (o.op == OP_GATED) {
          const Act a = act_and_grad_fp32(IO::load(rr[i]), sig);
          float t = xhat, u;
          if (hf) {
            t = IO::rt(xhat);
            u = mul(t, w[i]);
            if (w_in) u = IO::rt(u);
          } else {
            u = mul(xhat, w[i]);
          }
          d2r[i] = IO::store(mul(mul(dy32, u), a.da));
          float du = mul(dy32, a.a);
          if (hf) {
            if (w_in) du = IO::rt(du);
            dxhat = IO::rt(mul(du, w[i]));
          } else {
            dxhat = mul(du, w[i]);
          }
          cr[i] = mul(du, t);
        } else {
          dxhat = mul(dy32, g[i]);
          cr[i] = mul(dy32, xhat);
        }
        dxh[i] = dxhat;
        buf[i] = mul(dxhat, xhat);
      }
      std::fill(buf.begin() + H, buf.end(), 0.0f);
      const float m = div_by_count(tree_fold(buf.data(), P), H);
      T* dxr = dx + row * H;
      if (op_adds_dres(o.op)) {
        const T* dresr = dres + row * dresv->stride;
        for (int64_t i = 0; i < H; ++i) {
          float dsn = mul(rstd, sub(dxh[i], mul(mul(s[i], rstd), m)));
          if (rounded) dsn = IO::rt(dsn);
          const T ds = IO::store(add(dsn, IO::load(dresr[i])));
          dxr[i] = ds;
          if (d2r != nullptr) d2r[i] = ds;
        }
      } else {
        for (int64_t i = 0; i < H; ++i)
          dxr[i] = IO::store(mul(rstd, sub(dxh[i], mul(mul(s[i], rstd), m))));
      }
    }
  });
  if (n < block) std::fill(cb + n * H, cb + block * H, 0.0f);  // the last block's padding
  partials.push_back(row_tree(contrib).clone());  // a block of one row is a view
  }
  if (partials.size() == 1) return partials[0];
  return row_tree(at::stack(partials));
}

template <typename F>
void dispatch_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "normspec: unsupported dtype ", t);
  }
}

Opts make_opts(int op, const at::Tensor& x, const at::Tensor& w, double eps, double offset,
               int extra) {
  Opts o;
  o.op = op;
  o.eps32 = static_cast<float>(eps);
  o.offset32 = static_cast<float>(offset);
  o.flags = extra | rms_flags(offset);
  if (w.scalar_type() == x.scalar_type()) o.flags |= F_W_IS_INPUT;
  return o;
}

at::Tensor new_rows(const at::Tensor& x) { return at::empty(x.sizes(), x.options()); }

// ---- operators ---------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps, double offset, bool with_rstd) {
  check_norm_args(x, {}, weight, eps, offset);
  at::Tensor y = new_rows(x), rstd = rstd_if(with_rstd, x);
  if (x.numel() == 0) return {y, rstd};
  const Opts o = make_opts(OP_RMS, x, weight, eps, offset, 0);
  const RowView xv = row_view(x);
  const at::Tensor w = weight_f32(weight);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    forward_impl<T>(o, xv, nullptr, w.data_ptr<float>(), y.data_ptr<T>(), nullptr,
                    rstd_ptr(rstd));
  });
  return {y, rstd};
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                        double offset) {
  return std::get<0>(rms_norm_impl(x, weight, eps, offset, false));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_with_rstd_cpu(const at::Tensor& x,
                                                          const at::Tensor& weight, double eps,
                                                          double offset) {
  return rms_norm_impl(x, weight, eps, offset, true);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& dy, const at::Tensor& x,
                                                         const at::Tensor& weight, double eps,
                                                         double offset,
                                                         const c10::optional<at::Tensor>& rstd) {
  check_norm_args(x, {{"dy", dy}}, weight, eps, offset);
  const float* given = given_rstd(rstd, x);
  at::Tensor dx = new_rows(x);
  if (x.numel() == 0) return {dx, at::zeros_like(weight)};
  const Opts o = make_opts(OP_RMS, x, weight, eps, offset, 0);
  const RowView xv = row_view(x), dyv = row_view(dy);
  const at::Tensor w = weight_f32(weight);
  at::Tensor contrib;
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    contrib = backward_impl<T>(o, dyv, xv, nullptr, nullptr, w.data_ptr<float>(),
                               dx.data_ptr<T>(), nullptr, given);
  });
  return {dx, contrib.to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_impl(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    double offset, c10::string_view residual_sum, bool with_rstd) {
  check_norm_args(x, {{"residual", residual}}, weight, eps, offset);
  const bool rounded = parse_residual_sum(residual_sum);
  at::Tensor y = new_rows(x), res = new_rows(x), rstd = rstd_if(with_rstd, x);
  if (x.numel() == 0) return {y, res, rstd};
  const Opts o = make_opts(OP_FUSED, x, weight, eps, offset, rounded ? F_ROUNDED : 0);
  const RowView xv = row_view(x), rv = row_view(residual);
  const at::Tensor w = weight_f32(weight);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    forward_impl<T>(o, xv, &rv, w.data_ptr<float>(), y.data_ptr<T>(), res.data_ptr<T>(),
                    rstd_ptr(rstd));
  });
  return {y, res, rstd};
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x,
                                                          const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps,
                                                          double offset,
                                                          c10::string_view residual_sum) {
  auto out = fused_add_rms_norm_impl(x, residual, weight, eps, offset, residual_sum, false);
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_with_rstd_cpu(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    double offset, c10::string_view residual_sum) {
  return fused_add_rms_norm_impl(x, residual, weight, eps, offset, residual_sum, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_backward_cpu(
    const at::Tensor& dy, const at::Tensor& dresidual_out, const at::Tensor& x,
    const at::Tensor& residual, const at::Tensor& weight, double eps, double offset,
    c10::string_view residual_sum, const c10::optional<at::Tensor>& rstd) {
  check_norm_args(x, {{"residual", residual}, {"dy", dy}, {"dresidual_out", dresidual_out}},
                  weight, eps, offset);
  const bool rounded = parse_residual_sum(residual_sum);
  const float* given = given_rstd(rstd, x);
  at::Tensor dx = new_rows(x), dres = new_rows(x);
  if (x.numel() == 0) return {dx, dres, at::zeros_like(weight)};
  const Opts o = make_opts(OP_FUSED, x, weight, eps, offset, rounded ? F_ROUNDED : 0);
  const RowView xv = row_view(x), rv = row_view(residual), dyv = row_view(dy),
                dresv = row_view(dresidual_out);
  const at::Tensor w = weight_f32(weight);
  at::Tensor contrib;
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    contrib = backward_impl<T>(o, dyv, xv, &rv, &dresv, w.data_ptr<float>(), dx.data_ptr<T>(),
                               dres.data_ptr<T>(), given);
  });
  return {dx, dres, contrib.to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_backward_from_sum_cpu(
    const at::Tensor& dy, const at::Tensor& dresidual_out, const at::Tensor& s,
    const at::Tensor& weight, double eps, double offset, c10::string_view residual_sum,
    const c10::optional<at::Tensor>& rstd) {
  check_norm_args(s, {{"dy", dy}, {"dresidual_out", dresidual_out}}, weight, eps, offset);
  const bool rounded = parse_sum_convention(residual_sum, s);
  const float* given = given_rstd(rstd, s);
  at::Tensor ds = new_rows(s);
  if (s.numel() == 0) return {ds, at::zeros_like(weight)};
  const Opts o = make_opts(OP_FUSED_SUM, s, weight, eps, offset, rounded ? F_ROUNDED : 0);
  const RowView sv = row_view(s), dyv = row_view(dy), dresv = row_view(dresidual_out);
  const at::Tensor w = weight_f32(weight);
  at::Tensor contrib;
  dispatch_dtype(s.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    contrib = backward_impl<T>(o, dyv, sv, nullptr, &dresv, w.data_ptr<float>(),
                               ds.data_ptr<T>(), nullptr, given);
  });
  return {ds, contrib.to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_gated_impl(const at::Tensor& x,
                                                       const at::Tensor& gate,
                                                       const at::Tensor& weight, double eps,
                                                       c10::string_view convention,
                                                       c10::string_view activation,
                                                       bool with_rstd) {
  check_rows_weight_eps(x, {{"gate", gate}}, weight, eps);
  const int extra = gated_flags(convention, activation);
  at::Tensor y = new_rows(x), rstd = rstd_if(with_rstd, x);
  if (x.numel() == 0) return {y, rstd};
  const Opts o = make_opts(OP_GATED, x, weight, eps, 0.0, extra);
  const RowView xv = row_view(x), gv = row_view(gate);
  const at::Tensor w = weight_f32(weight);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    forward_impl<T>(o, xv, &gv, w.data_ptr<float>(), y.data_ptr<T>(), nullptr, rstd_ptr(rstd));
  });
  return {y, rstd};
}

at::Tensor rms_norm_gated_cpu(const at::Tensor& x, const at::Tensor& gate,
                              const at::Tensor& weight, double eps, c10::string_view convention,
                              c10::string_view activation) {
  return std::get<0>(rms_norm_gated_impl(x, gate, weight, eps, convention, activation, false));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_gated_with_rstd_cpu(
    const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
    c10::string_view convention, c10::string_view activation) {
  return rms_norm_gated_impl(x, gate, weight, eps, convention, activation, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_gated_backward_cpu(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
    double eps, c10::string_view convention, c10::string_view activation,
    const c10::optional<at::Tensor>& rstd) {
  check_rows_weight_eps(x, {{"gate", gate}, {"dy", dy}}, weight, eps);
  const int extra = gated_flags(convention, activation);
  const float* given = given_rstd(rstd, x);
  at::Tensor dx = new_rows(x), dgate = new_rows(x);
  if (x.numel() == 0) return {dx, dgate, at::zeros_like(weight)};
  const Opts o = make_opts(OP_GATED, x, weight, eps, 0.0, extra);
  const RowView xv = row_view(x), gv = row_view(gate), dyv = row_view(dy);
  const at::Tensor w = weight_f32(weight);
  at::Tensor contrib;
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    contrib = backward_impl<T>(o, dyv, xv, &gv, nullptr, w.data_ptr<float>(), dx.data_ptr<T>(),
                               dgate.data_ptr<T>(), given);
  });
  return {dx, dgate, contrib.to(weight.scalar_type())};
}

}  // namespace
}  // namespace normspec

TORCH_LIBRARY_IMPL(normspec, CPU, m) {
  m.impl("rms_norm", &normspec::rms_norm_cpu);
  m.impl("rms_norm_with_rstd", &normspec::rms_norm_with_rstd_cpu);
  m.impl("fused_add_rms_norm_with_rstd", &normspec::fused_add_rms_norm_with_rstd_cpu);
  m.impl("rms_norm_gated_with_rstd", &normspec::rms_norm_gated_with_rstd_cpu);
  m.impl("rms_norm_backward", &normspec::rms_norm_backward_cpu);
  m.impl("fused_add_rms_norm", &normspec::fused_add_rms_norm_cpu);
  m.impl("fused_add_rms_norm_backward", &normspec::fused_add_rms_norm_backward_cpu);
  m.impl("fused_add_rms_norm_backward_from_sum",
         &normspec::fused_add_rms_norm_backward_from_sum_cpu);
  m.impl("rms_norm_gated", &normspec::rms_norm_gated_cpu);
  m.impl("rms_norm_gated_backward", &normspec::rms_norm_gated_backward_cpu);
}
