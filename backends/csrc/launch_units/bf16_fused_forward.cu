// The bfloat16 forward kernels of fused_add_rms_norm: one launch unit (normspec_launch_impl.cuh).
#define NORMSPEC_NO_COL_TREE
#include "normspec_launch_impl.cuh"
NORMSPEC_FORWARD_UNIT(OP_FUSED, __nv_bfloat16)
