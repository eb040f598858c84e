// The float32 backward kernels of fused_add_rms_norm from the sum: one launch unit (normspec_launch_impl.cuh).
#define NORMSPEC_NO_COL_TREE
#include "normspec_launch_impl.cuh"
NORMSPEC_BACKWARD_UNIT(OP_FUSED_SUM, float)
