// The bfloat16 backward kernels of rms_norm: one launch unit (normspec_launch_impl.cuh).
#define NORMSPEC_NO_COL_TREE
#include "normspec_launch_impl.cuh"
NORMSPEC_BACKWARD_UNIT(OP_RMS, __nv_bfloat16)
