// The __half kernels of normspec_launch_impl.cuh (one translation unit per dtype,
// compiled in parallel).
// normspec_col_tree_kernel (not a template) is defined in normspec_launch.cu only.
#define NORMSPEC_NO_COL_TREE
#include "normspec_launch_impl.cuh"

namespace normspec {
namespace launch_detail {
template void dispatch_op<__half>(int op, bool backward, const LaunchArgs& a, float* ws,
                                  const BackwardPlan* plan, cudaStream_t stream);
}  // namespace launch_detail
}  // namespace normspec
