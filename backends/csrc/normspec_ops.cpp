// The normspec operator schemas, declared once. CPU implementations live in
// normspec_cpu.cpp, CUDA implementations in normspec_cuda.cpp (kernels in
// normspec_kernels.cuh, launched by normspec_launch.cu); fake (meta)
// implementations and autograd are registered from Python
// (normspec.backends.torch_ext).
#include <torch/library.h>

TORCH_LIBRARY(normspec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor weight, float eps, float offset)"
      " -> (Tensor, Tensor)");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset,"
      " str residual_sum) -> (Tensor, Tensor)");
  m.def(
      "fused_add_rms_norm_backward(Tensor dy, Tensor dresidual_out, Tensor x, Tensor residual,"
      " Tensor weight, float eps, float offset, str residual_sum) -> (Tensor, Tensor, Tensor)");
  m.def(
      "rms_norm_gated(Tensor x, Tensor gate, Tensor weight, float eps, str convention,"
      " str activation) -> Tensor");
  m.def(
      "rms_norm_gated_backward(Tensor dy, Tensor x, Tensor gate, Tensor weight, float eps,"
      " str convention, str activation) -> (Tensor, Tensor, Tensor)");
}
