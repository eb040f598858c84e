// The normspec operator schemas, declared once. CPU implementations live in
// normspec_cpu.cpp, CUDA implementations in normspec_cuda.cpp (kernels in
// normspec_kernels.cuh, launched by normspec_launch.cu); fake (meta)
// implementations and autograd are registered from Python
// (normspec.backends.torch_ext).
//
// The *_with_rstd forwards also return rstd (fp32, one value per row), which
// the autograd path passes to the backward operators: the spec fixes its bits,
// so the backward may read it instead of recomputing it (`rstd=None`: recompute).
#include <torch/library.h>

TORCH_LIBRARY(normspec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def(
      "rms_norm_with_rstd(Tensor x, Tensor weight, float eps, float offset)"
      " -> (Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor weight, float eps, float offset,"
      " Tensor? rstd=None) -> (Tensor, Tensor)");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset,"
      " str residual_sum) -> (Tensor, Tensor)");
  m.def(
      "fused_add_rms_norm_with_rstd(Tensor x, Tensor residual, Tensor weight, float eps,"
      " float offset, str residual_sum) -> (Tensor, Tensor, Tensor)");
  m.def(
      "fused_add_rms_norm_backward(Tensor dy, Tensor dresidual_out, Tensor x, Tensor residual,"
      " Tensor weight, float eps, float offset, str residual_sum, Tensor? rstd=None)"
      " -> (Tensor, Tensor, Tensor)");
  // the backward from the sum s the norm read (the new residual): ds = dx = dresidual
  m.def(
      "fused_add_rms_norm_backward_from_sum(Tensor dy, Tensor dresidual_out, Tensor s,"
      " Tensor weight, float eps, float offset, str residual_sum, Tensor? rstd=None)"
      " -> (Tensor, Tensor)");
  m.def(
      "rms_norm_gated(Tensor x, Tensor gate, Tensor weight, float eps, str convention,"
      " str activation) -> Tensor");
  m.def(
      "rms_norm_gated_with_rstd(Tensor x, Tensor gate, Tensor weight, float eps,"
      " str convention, str activation) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_gated_backward(Tensor dy, Tensor x, Tensor gate, Tensor weight, float eps,"
      " str convention, str activation, Tensor? rstd=None) -> (Tensor, Tensor, Tensor)");
}
