"""The kernels: each launch plan's kernel by name, and the kernels each module holds.

``kernel_name`` spells the kernel of a launch plan (``planner``) as a name expression (its
template arguments as NVRTC instantiates them); ``name_expressions`` lists every
instantiation the plans can reach, per (op, dtype) and part (``MODULES``), which is what
the NVRTC modules compile.
"""

from __future__ import annotations

from .codes import (
    CUDA_TYPES,
    DT_BF16,
    DT_F16,
    DT_F32,
    NPS,
    OP_FUSED,
    OP_FUSED_SUM,
    OP_GATED,
    OP_RMS,
)
from .planner import (
    K_BWD_PAIR,
    K_BWD_PIPE,
    K_BWD_REGISTER,
    K_BWD_ROW,
    K_BWD_STREAM,
    K_FWD_PIPE,
    K_FWD_QUAD,
    K_FWD_REGISTER,
    K_FWD_ROW,
    K_FWD_STREAM,
    LaunchPlan,
)


def kernel_name(op: int, dtype_code: int, p: LaunchPlan) -> str:
    """The name expression of the kernel that the plan ``p`` launches (its template
    arguments spelled as NVRTC instantiates them)."""
    t = CUDA_TYPES[dtype_code]
    saved = "true" if p.saved else "false"
    names = {
        K_FWD_REGISTER: lambda: f"normspec_fwd_kernel<{op}, {t}, {p.np}>",
        K_FWD_STREAM: lambda: f"normspec_fwd_stream_kernel<{op}, {t}>",
        K_FWD_ROW: lambda: (
            f"normspec_fwd_row_kernel<{op}, {t}, 2, {p.full_tl}, true, {p.gt_form}>"
            if p.gt_form else f"normspec_fwd_row_kernel<{op}, {t}, {p.np}, {p.full_tl}>"),
        K_FWD_QUAD: lambda: f"normspec_fwd_quad_kernel<{op}, {t}, {p.np}>",
        K_FWD_PIPE: lambda: f"normspec_fwd_pipe_kernel<{op}, {t}, {p.np}, {p.full_tl}>",
        K_BWD_REGISTER: lambda: f"normspec_bwd_kernel<{op}, {t}, {p.np}>",
        K_BWD_STREAM: lambda: f"normspec_bwd_stream_kernel<{op}, {t}>",
        K_BWD_ROW: lambda: f"normspec_bwd_row_kernel<{t}, {p.np}, {p.full_tl}, {saved}>",
        K_BWD_PIPE: lambda: (f"normspec_bwd_pipe_kernel<{op}, {t}, {p.np}, {p.full_tl}, "
                             f"{saved}, {p.gc}>"),
        K_BWD_PAIR: lambda: (f"normspec::normspec_gated_bwd_pair_kernel<{t}, {p.full_tl}, "
                             f"{p.gc}>"),
    }
    return names[p.kernel]()


#: lanes (log2) a row of the quad forward, by the row's length (``quad_lanes_log``)
QUAD_LANES_LOG = {256: 6, 128: 5}


def row_default_np(op: int) -> int:
    return 4 if op == OP_RMS else 2


#: Team sizes (log2) of the one-row forward's forms that read act(z) from the global gate
#: table (``global_table_plan``: two passes, rows of 64..1024 bf16).
GLOBAL_TABLE_TEAM_LOGS = range(2, 7)
#: The kernel that fills the global gate table of one activation.
FILL_GATE_TABLE_KERNEL = "normspec_fill_gate_table_kernel<__nv_bfloat16>"


#: The pipelined backward's constant forms: (NP, team_log).
_BWD_FULL_FORMS = ((1, 4), (1, 5), (2, 7), (2, 8))
#: The one-row rms backward's forms: the constant forms and the wide one (256 x 1).
_BWD_ROW_FORMS = (*_BWD_FULL_FORMS, (1, 8))
#: The gated backward's convention constants (``gated_gc``).
_GATED_GCS = (0, 1, 7)
#: The GT forward's forms (``gt_form``).
_GT_FORMS = range(1, 6)


def _backward_names(op: int, t: str) -> list[str]:
    """The backward kernels of one (op, dtype) module, the dweight tree's included."""
    names = [
        *(f"normspec_bwd_kernel<{op}, {t}, {n}>" for n in NPS),
        *(f"normspec_bwd_pipe_kernel<{op}, {t}, {n}, -1, {s}, -1>"
          for s in ("false", "true") for n in NPS),
        *(f"normspec_bwd_pipe_kernel<{op}, {t}, {n}, {tl}, {s}, -1>"
          for s in ("false", "true") for n, tl in _BWD_FULL_FORMS),
        f"normspec_bwd_stream_kernel<{op}, {t}>",
    ]
    if op == OP_RMS:
        names += [f"normspec_bwd_row_kernel<{t}, {n}, {tl}, {s}>"
                  for s in ("false", "true") for n, tl in _BWD_ROW_FORMS]
    if op == OP_GATED and t == CUDA_TYPES[DT_BF16]:
        names += [f"normspec_bwd_pipe_kernel<{op}, {t}, 1, {tl}, true, {gc}>"
                  for tl in (4, 5) for gc in _GATED_GCS]
        names += [f"normspec::normspec_gated_bwd_pair_kernel<{t}, {tl}, {gc}>"
                  for tl in (4, 5) for gc in _GATED_GCS]
    # the tree; the last tree kernel for an fp32 weight or one of the input dtype
    return [*names, "normspec_col_tree_kernel",
            *dict.fromkeys(f"normspec_col_tree_last_kernel<{w}>" for w in ("float", t))]


#: The two modules of an (op, dtype): its forward kernels and its backward kernels (those
#: of the dweight tree included), compiled apart so that a machine's first compiles run
#: side by side in halves.
PARTS = ("forward", "backward")
#: Name prefixes of the kernels a backward module holds (``kernel_part``).
_BACKWARD_PREFIXES = ("normspec_bwd_", "normspec::normspec_gated_bwd_pair_kernel",
                      "normspec_col_tree")


def kernel_part(name: str) -> str:
    """The module (``PARTS``) that holds the kernel ``name`` (a name expression)."""
    return "backward" if name.startswith(_BACKWARD_PREFIXES) else "forward"


def name_expressions(op: int, dtype_code: int, part: str | None = None) -> list[str]:
    """Every instantiation one (op, dtype) holds (all the launchers can pick): the
    ``part`` module's, ``"forward"`` or ``"backward"``, or by default both together.
    ``OP_FUSED_SUM`` has backward kernels only. Raises ``ValueError`` for another
    ``part``."""
    t = CUDA_TYPES[dtype_code]
    if part not in (None, *PARTS):
        raise ValueError(f"part: expected one of {PARTS} or None, got {part!r}")
    backward = _backward_names(op, t) if part != "forward" else []
    if op == OP_FUSED_SUM or part == "backward":
        return backward
    dnp = row_default_np(op)
    return [
        *(f"normspec_fwd_row_kernel<{op}, {t}, {n}, -1>" for n in NPS),
        *(f"normspec_fwd_row_kernel<{op}, {t}, {dnp}, {tl}>" for tl in range(1, 9)),
        *(f"normspec_fwd_row_kernel<{op}, {t}, 1, {tl}>" for tl in range(4, 9)),
        *(f"normspec_fwd_quad_kernel<{op}, {t}, {ll}>" for ll in QUAD_LANES_LOG.values()
          if dtype_code != DT_F32 and op in (OP_RMS, OP_FUSED)),
        *(f"normspec_fwd_kernel<{op}, {t}, {n}>" for n in NPS),
        f"normspec_fwd_stream_kernel<{op}, {t}>",
        *(f"normspec_fwd_pipe_kernel<{op}, {t}, {n}, -1>" for n in NPS),
        *backward,
        # the global gate table and the forms that read it (large bf16 gated forwards)
        *((FILL_GATE_TABLE_KERNEL,
           *(f"normspec_fwd_row_kernel<{op}, {t}, 2, {tl}, true, {f}>"
             for f in _GT_FORMS for tl in GLOBAL_TABLE_TEAM_LOGS),
           # the persistent forward's constant forms (with the per-block table)
           *(f"normspec_fwd_pipe_kernel<{op}, {t}, {n}, {tl}>"
             for n in (1, 2) for tl in range(2, 6)))
          if op == OP_GATED and dtype_code == DT_BF16 else ()),
    ]


#: every module's (op, dtype, part): what ``available()`` and ``normspec build`` prepare
MODULES = tuple((op, dt, part) for op in (OP_RMS, OP_FUSED, OP_GATED, OP_FUSED_SUM)
                for dt in (DT_F32, DT_BF16, DT_F16) for part in PARTS
                if not (op == OP_FUSED_SUM and part == "forward"))
