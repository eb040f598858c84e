// CUDA implementations of the normspec operators, registered for the CUDA
// dispatch key. The kernels live in normspec_kernels.cuh and are launched
// through the torch-free normspec_launch.cu; this file (plain C++, so that
// nvcc never has to parse the torch headers) does the checks, the row views,
// the allocations (caching allocator only) and passes the current stream: no
// host synchronisation anywhere, so the operators are CUDA-graph safe.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>

#include "normspec_host.h"
#include "normspec_launch.h"

namespace normspec {
namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DT_F32;
    case at::kBFloat16:
      return DT_BF16;
    case at::kHalf:
      return DT_F16;
    default:
      TORCH_CHECK(false, "normspec: unsupported dtype ", t);
  }
  return -1;
}

at::Tensor new_rows(const at::Tensor& x) { return at::empty(x.sizes(), x.options()); }

int base_flags(const at::Tensor& x, const at::Tensor& w, double offset) {
  int flags = rms_flags(offset);
  if (w.scalar_type() == x.scalar_type()) flags |= F_W_IS_INPUT;
  return flags;
}

LaunchArgs base_args(const RowView& xv, double eps, double offset, int flags) {
  LaunchArgs a;
  a.x = xv.t.data_ptr();
  a.sx = xv.stride;
  a.rows = xv.rows;
  a.H = xv.hidden;
  a.eps = static_cast<float>(eps);
  a.offset = static_cast<float>(offset);
  a.flags = flags;
  return a;
}

// A backward's launch arguments: base_args of the rows the norm read (`nv`), the
// gradient rows `dyv`, the gradient rows written to `dn` and the forward's rstd where
// given (else nullptr). The views stay the caller's: a view may hold a contiguous
// copy, which must outlive the launch.
LaunchArgs backward_args(const RowView& nv, double eps, double offset, int flags,
                         const RowView& dyv, const at::Tensor& dn, const float* given) {
  LaunchArgs a = base_args(nv, eps, offset, flags);
  a.dy = dyv.t.data_ptr();
  a.sdy = dyv.stride;
  a.y = dn.data_ptr();
  a.sy = nv.hidden;
  a.rstd_in = given;
  return a;
}

// The weight as the kernels read it. A contiguous 16-bit weight of the input
// dtype is offered as it is (a.w_in_dtype): the pipelined kernels widen it
// exactly, which saves an fp32 copy and its kernel launch per call.
void offer_weight_as_is(LaunchArgs& a, int dt, const at::Tensor& x, const at::Tensor& weight) {
  if (dt != DT_F32 && weight.scalar_type() == x.scalar_type() && weight.is_contiguous())
    a.w_in_dtype = weight.data_ptr();
}

// Where the launch will not read it as it is: an fp32 copy (returned, so that it
// lives until the launch is queued; the caching allocator orders its reuse).
at::Tensor weight_fp32_unless_as_is(LaunchArgs& a, int op, int dt, const BackwardPlan* plan,
                                    const at::Tensor& weight) {
  if (reads_weight_in_input_dtype(op, dt, a, plan)) return at::Tensor();
  a.w_in_dtype = nullptr;
  at::Tensor w = weight_f32(weight);
  a.w = w.data_ptr<float>();
  return w;
}

void forward(int op, const at::Tensor& x, const at::Tensor& weight, LaunchArgs a) {
  const int dt = dtype_code(x.scalar_type());
  offer_weight_as_is(a, dt, x, weight);
  const at::Tensor w32 = weight_fp32_unless_as_is(a, op, dt, nullptr, weight);
  C10_CUDA_CHECK(launch_forward(op, dt, a, c10::cuda::getCurrentCUDAStream()));
}

// Runs the backward kernel and the dweight row tree; returns dweight in the
// weight's dtype. Tree levels of 16 rows run until at most kColTreeLastMax are left;
// one launch folds those and casts (instead of up to two more levels and a .to()).
at::Tensor backward(int op, const at::Tensor& x, const at::Tensor& weight, LaunchArgs a) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int dt = dtype_code(x.scalar_type());
  const int sms = current_device_sms();
  offer_weight_as_is(a, dt, x, weight);
  BackwardPlan plan = backward_plan_for(dt, a, sms);
  const at::Tensor w32 = weight_fp32_unless_as_is(a, op, dt, &plan, weight);
  if (w32.defined()) plan = backward_plan_for(dt, a, sms);  // the alignment may differ
  if (writes_dweight_final(dt, dtype_code(weight.scalar_type()), plan)) {
    // one group: the backward kernel stores dweight in the weight's dtype itself
    at::Tensor dweight = at::empty({a.H}, x.options().dtype(weight.scalar_type()));
    a.flags |= F_DW_FINAL;
    C10_CUDA_CHECK(launch_backward(op, dt, a, static_cast<float*>(dweight.data_ptr()), plan,
                                   stream));
    return dweight;
  }
  const at::TensorOptions fopts = x.options().dtype(at::kFloat);
  at::Tensor ws = at::empty({plan.groups, a.H}, fopts);
  long long G = plan.groups;
  // tree kernels follow unless one fp32 row is the answer
  const bool fp32_weight = weight.scalar_type() == at::kFloat;
  const bool tree_follows = !(G == 1 && fp32_weight);
  if (tree_follows && chained_launches(stream)) a.flags |= F_LET_DEPENDENTS;
  C10_CUDA_CHECK(launch_backward(op, dt, a, ws.data_ptr<float>(), plan, stream));
  while (G > kColTreeLastMax) {
    const long long gout = col_tree_rows_out(G);
    at::Tensor out = at::empty({gout, a.H}, fopts);
    C10_CUDA_CHECK(launch_col_tree(ws.data_ptr<float>(), out.data_ptr<float>(), G, a.H, stream));
    ws = out;
    G = gout;
  }
  // one fp32 row already is an fp32 weight's dweight
  if (G == 1 && fp32_weight) return ws.view({a.H});
  // the last levels and the cast to the weight's dtype: one launch
  at::Tensor dweight = at::empty({a.H}, x.options().dtype(weight.scalar_type()));
  C10_CUDA_CHECK(launch_col_tree_last(ws.data_ptr<float>(), dweight.data_ptr(),
                                      dtype_code(weight.scalar_type()), G, a.H, stream));
  return dweight;
}

// ---- operators -------------------------------------------------------------------
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const at::Tensor& weight,
                                                 double eps, double offset, bool with_rstd) {
  check_norm_args(x, {}, weight, eps, offset);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_rows(x), rstd = rstd_if(with_rstd, x);
  if (x.numel() == 0) return {y, rstd};
  const RowView xv = row_view(x);
  LaunchArgs a = base_args(xv, eps, offset, base_flags(x, weight, offset));
  a.y = y.data_ptr();
  a.sy = xv.hidden;
  a.rstd_out = rstd_ptr(rstd);
  forward(OP_RMS, x, weight, a);
  return {y, rstd};
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                         double offset) {
  return std::get<0>(rms_norm_impl(x, weight, eps, offset, false));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_with_rstd_cuda(const at::Tensor& x,
                                                           const at::Tensor& weight, double eps,
                                                           double offset) {
  return rms_norm_impl(x, weight, eps, offset, true);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& dy,
                                                          const at::Tensor& x,
                                                          const at::Tensor& weight, double eps,
                                                          double offset,
                                                          const c10::optional<at::Tensor>& rstd) {
  check_norm_args(x, {{"dy", dy}}, weight, eps, offset);
  const float* given = given_rstd(rstd, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_rows(x);
  if (x.numel() == 0) return {dx, at::zeros_like(weight)};
  const RowView xv = row_view(x), dyv = row_view(dy);
  const LaunchArgs a =
      backward_args(xv, eps, offset, base_flags(x, weight, offset), dyv, dx, given);
  at::Tensor dw = backward(OP_RMS, x, weight, a);
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_impl(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    double offset, c10::string_view residual_sum, bool with_rstd) {
  check_norm_args(x, {{"residual", residual}}, weight, eps, offset);
  const bool rounded = parse_residual_sum(residual_sum);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_rows(x), res = new_rows(x), rstd = rstd_if(with_rstd, x);
  if (x.numel() == 0) return {y, res, rstd};
  const RowView xv = row_view(x), rv = row_view(residual);
  LaunchArgs a = base_args(xv, eps, offset,
                           base_flags(x, weight, offset) | (rounded ? F_ROUNDED : 0));
  a.r = rv.t.data_ptr();
  a.sr = rv.stride;
  a.y = y.data_ptr();
  a.sy = xv.hidden;
  a.y2 = res.data_ptr();
  a.sy2 = xv.hidden;
  a.rstd_out = rstd_ptr(rstd);
  forward(OP_FUSED, x, weight, a);
  return {y, res, rstd};
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cuda(const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps,
                                                           double offset,
                                                           c10::string_view residual_sum) {
  auto out = fused_add_rms_norm_impl(x, residual, weight, eps, offset, residual_sum, false);
  return {std::get<0>(out), std::get<1>(out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_with_rstd_cuda(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    double offset, c10::string_view residual_sum) {
  return fused_add_rms_norm_impl(x, residual, weight, eps, offset, residual_sum, true);
}

// The launch arguments the two fused backwards share: backward_args and the new
// residual's gradient rows `drv`.
LaunchArgs fused_backward_args(const RowView& nv, const at::Tensor& n, const at::Tensor& weight,
                               double eps, double offset, bool rounded, const RowView& dyv,
                               const RowView& drv, const at::Tensor& dn, const float* given) {
  LaunchArgs a = backward_args(nv, eps, offset,
                               base_flags(n, weight, offset) | (rounded ? F_ROUNDED : 0), dyv,
                               dn, given);
  a.dres = drv.t.data_ptr();
  a.sdres = drv.stride;
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_backward_cuda(
    const at::Tensor& dy, const at::Tensor& dresidual_out, const at::Tensor& x,
    const at::Tensor& residual, const at::Tensor& weight, double eps, double offset,
    c10::string_view residual_sum, const c10::optional<at::Tensor>& rstd) {
  check_norm_args(x, {{"residual", residual}, {"dy", dy}, {"dresidual_out", dresidual_out}},
                  weight, eps, offset);
  const bool rounded = parse_residual_sum(residual_sum);
  const float* given = given_rstd(rstd, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_rows(x), dres = new_rows(x);
  if (x.numel() == 0) return {dx, dres, at::zeros_like(weight)};
  const RowView xv = row_view(x), rv = row_view(residual), dyv = row_view(dy),
                drv = row_view(dresidual_out);
  LaunchArgs a = fused_backward_args(xv, x, weight, eps, offset, rounded, dyv, drv, dx, given);
  a.r = rv.t.data_ptr();
  a.sr = rv.stride;
  a.y2 = dres.data_ptr();
  a.sy2 = xv.hidden;
  at::Tensor dw = backward(OP_FUSED, x, weight, a);
  return {dx, dres, dw};
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_backward_from_sum_cuda(
    const at::Tensor& dy, const at::Tensor& dresidual_out, const at::Tensor& s,
    const at::Tensor& weight, double eps, double offset, c10::string_view residual_sum,
    const c10::optional<at::Tensor>& rstd) {
  check_norm_args(s, {{"dy", dy}, {"dresidual_out", dresidual_out}}, weight, eps, offset);
  const bool rounded = parse_sum_convention(residual_sum, s);
  const float* given = given_rstd(rstd, s);
  const c10::cuda::CUDAGuard guard(s.device());
  at::Tensor ds = new_rows(s);
  if (s.numel() == 0) return {ds, at::zeros_like(weight)};
  const RowView sv = row_view(s), dyv = row_view(dy), drv = row_view(dresidual_out);
  const LaunchArgs a = fused_backward_args(sv, s, weight, eps, offset, rounded, dyv, drv, ds,
                                           given);
  at::Tensor dw = backward(OP_FUSED_SUM, s, weight, a);
  return {ds, dw};
}

int gated_launch_flags(const at::Tensor& x, const at::Tensor& weight, c10::string_view convention,
                       c10::string_view activation) {
  return base_flags(x, weight, 0.0) | gated_flags(convention, activation);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_gated_impl(const at::Tensor& x,
                                                       const at::Tensor& gate,
                                                       const at::Tensor& weight, double eps,
                                                       c10::string_view convention,
                                                       c10::string_view activation,
                                                       bool with_rstd) {
  check_rows_weight_eps(x, {{"gate", gate}}, weight, eps);
  const int flags = gated_launch_flags(x, weight, convention, activation);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = new_rows(x), rstd = rstd_if(with_rstd, x);
  if (x.numel() == 0) return {y, rstd};
  const RowView xv = row_view(x), gv = row_view(gate);
  LaunchArgs a = base_args(xv, eps, 0.0, flags);
  a.r = gv.t.data_ptr();
  a.sr = gv.stride;
  a.y = y.data_ptr();
  a.sy = xv.hidden;
  a.rstd_out = rstd_ptr(rstd);
  forward(OP_GATED, x, weight, a);
  return {y, rstd};
}

at::Tensor rms_norm_gated_cuda(const at::Tensor& x, const at::Tensor& gate,
                               const at::Tensor& weight, double eps, c10::string_view convention,
                               c10::string_view activation) {
  return std::get<0>(rms_norm_gated_impl(x, gate, weight, eps, convention, activation, false));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_gated_with_rstd_cuda(
    const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
    c10::string_view convention, c10::string_view activation) {
  return rms_norm_gated_impl(x, gate, weight, eps, convention, activation, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_gated_backward_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight,
    double eps, c10::string_view convention, c10::string_view activation,
    const c10::optional<at::Tensor>& rstd) {
  check_rows_weight_eps(x, {{"gate", gate}, {"dy", dy}}, weight, eps);
  const int flags = gated_launch_flags(x, weight, convention, activation);
  const float* given = given_rstd(rstd, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = new_rows(x), dgate = new_rows(x);
  if (x.numel() == 0) return {dx, dgate, at::zeros_like(weight)};
  const RowView xv = row_view(x), gv = row_view(gate), dyv = row_view(dy);
  LaunchArgs a = backward_args(xv, eps, 0.0, flags, dyv, dx, given);
  a.r = gv.t.data_ptr();
  a.sr = gv.stride;
  a.y2 = dgate.data_ptr();
  a.sy2 = xv.hidden;
  at::Tensor dw = backward(OP_GATED, x, weight, a);
  return {dx, dgate, dw};
}

}  // namespace
}  // namespace normspec

TORCH_LIBRARY_IMPL(normspec, CUDA, m) {
  m.impl("rms_norm", &normspec::rms_norm_cuda);
  m.impl("rms_norm_with_rstd", &normspec::rms_norm_with_rstd_cuda);
  m.impl("fused_add_rms_norm_with_rstd", &normspec::fused_add_rms_norm_with_rstd_cuda);
  m.impl("rms_norm_gated_with_rstd", &normspec::rms_norm_gated_with_rstd_cuda);
  m.impl("rms_norm_backward", &normspec::rms_norm_backward_cuda);
  m.impl("fused_add_rms_norm", &normspec::fused_add_rms_norm_cuda);
  m.impl("fused_add_rms_norm_backward", &normspec::fused_add_rms_norm_backward_cuda);
  m.impl("fused_add_rms_norm_backward_from_sum",
         &normspec::fused_add_rms_norm_backward_from_sum_cuda);
  m.impl("rms_norm_gated", &normspec::rms_norm_gated_cuda);
  m.impl("rms_norm_gated_backward", &normspec::rms_norm_gated_backward_cuda);
}
