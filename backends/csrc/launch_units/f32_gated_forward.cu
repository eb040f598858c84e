// The float32 forward kernels of rms_norm_gated: one launch unit (normspec_launch_impl.cuh).
#define NORMSPEC_NO_COL_TREE
#include "normspec_launch_impl.cuh"
NORMSPEC_FORWARD_UNIT(OP_GATED, float)
