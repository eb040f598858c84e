"""The codes the kernels take: operators, dtypes, flags, and the launcher's constants.

The values are those of ``normspec_arith.h`` and ``normspec_plan.h`` in
``backends/csrc``; the CuPy backend passes them to the same kernels the torch extension
launches.
"""

from __future__ import annotations

import torch

# ---- constants of normspec_arith.h / normspec_launch.h --------------------------------
OP_RMS, OP_FUSED, OP_GATED = 0, 1, 2
#: The fused op's backward given the sum s its norm read (a backward only): x = s, no
#: residual row, one gradient row ds (= dx = dresidual).
OP_FUSED_SUM = 3
OP_CODES = {"rms_norm": OP_RMS, "fused_add_rms_norm": OP_FUSED, "rms_norm_gated": OP_GATED}
F_OFFSET, F_ROUNDED, F_HF, F_SIGMOID, F_W_IS_INPUT, F_ALIGNED = 1, 2, 4, 8, 16, 32
F_GATE_TABLE, F_W_RAW, F_DW_FINAL, F_LET_DEPENDENTS = 64, 128, 256, 512
# normspec_plan.h: static shared memory kept free, the gate table's slots and the
# smallest launch that fills it, the plan's stack budget per block and levels
STATIC_SMEM_ROOM = 2048
GATE_TABLE_SLOTS = 8192
GATE_TABLE_MIN_ELEMENTS = 1 << 20
PIPE_STACK_BUDGET = 40960
PIPE_PLAN_LEVELS = 5
DT_F32, DT_BF16, DT_F16 = 0, 1, 2
#: Kernel template argument T of each dtype code.
CUDA_TYPES = {DT_F32: "float", DT_BF16: "__nv_bfloat16", DT_F16: "__half"}
TORCH_DT = {torch.float32: DT_F32, torch.bfloat16: DT_BF16, torch.float16: DT_F16}
CUPY_DT = {"float32": DT_F32, "bfloat16": DT_BF16, "float16": DT_F16}
DT_NAMES = {DT_F32: "float32", DT_BF16: "bfloat16", DT_F16: "float16"}
#: what each op code's module holds, as the compile notice names it
MODULE_LABELS = {OP_RMS: "rms_norm", OP_FUSED: "fused_add_rms_norm",
                  OP_GATED: "rms_norm_gated", OP_FUSED_SUM: "fused_add_rms_norm from the sum"}
NPS = (1, 2, 4)
