"""Which kernel each launch runs: the launcher's choices, and the kernels each module holds.

Each ``*_launch`` function returns the kernel's name expression (its template arguments
spelled as NVRTC instantiates them) with its grid, block and shared memory, as the C++
launcher of ``normspec_launch_impl.cuh`` picks them; ``name_expressions`` lists every
instantiation those choices can reach, per (op, dtype) and part (``MODULES``), which is
what the NVRTC modules compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .codes import (
    CUDA_TYPES,
    DT_BF16,
    DT_F16,
    DT_F32,
    GATE_TABLE_SLOTS,
    NPS,
    OP_FUSED,
    OP_FUSED_SUM,
    OP_GATED,
    OP_RMS,
)
from .geometry import (
    backward_geometry,
    bwd_row_wide,
    fits_smem,
    forward_geometry,
    gated_gc,
    grid_for,
    offsets_fit_32,
    pipe_backward_plan,
    pipe_block,
    pipe_forward_geometry,
    pipe_smem_bytes,
    row_block,
    row_geometry,
    row_index_fits_32,
    vec_of,
    wants_gate_table,
)


class BackwardLaunch(NamedTuple):
    """One launch of the pipelined backward's family (``launch_bwd_pipe``).

    ``name`` is the kernel's name expression: ``normspec_bwd_pipe_kernel`` (persistent
    teams), ``normspec_bwd_row_kernel`` (the rms norm's one-row groups, a team per row)
    or ``normspec_gated_bwd_pair_kernel`` (the gate-table backward, two rows a team per
    iteration); ``shape`` is ``(threads per block, dynamic shared memory, team_log)``."""

    name: str
    glog: int
    groups: int
    table: bool
    shape: tuple[int, int, int]

    @property
    def kind(self) -> str:
        """``"pipe"``, ``"row"`` or ``"pair"``: which kernel, hence which arguments."""
        if self.name.startswith("normspec_bwd_row_kernel"):
            return "row"
        if self.name.startswith("normspec::normspec_gated_bwd_pair_kernel"):
            return "pair"
        return "pipe"


def pipe_backward_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int,
                         optin: int, strides: Sequence[int] = (), *, saved: bool = False,
                         hf: bool = False, w_is_input: bool = False) -> BackwardLaunch | None:
    """The launch of the pipelined backward's family for aligned rows (``launch_bwd_pipe``
    of the torch extension's launcher), ``None`` where it does not apply (rows of more
    than 1024 vectors).

    Rows that fill the team exactly in the common geometries (one pass of 16 or 32 lanes,
    two of 128 or 256 threads) run the constant-geometry forms: for the rms norm's one-row
    groups ``normspec_bwd_row_kernel``, 256 threads x 1 pass instead of 128 x 2 where
    ``bwd_row_wide``; for the bf16 gated op with the gate table and the forward's rstd
    (`saved`) the convention as constants (``gated_gc`` of `hf` and `w_is_input`), in
    ``normspec_gated_bwd_pair_kernel`` where the groups have two rows or more and every
    offset fits 32 bits (``offsets_fit_32``; `strides`: the row strides of the launch's
    tensors). `saved`: the forward's rstd is given (and read)."""
    plan = pipe_backward_plan(dtype_code, rows, hidden, sm_count, optin)
    if plan is None:
        return None
    team_log, np_, glog, groups = plan
    vec = vec_of(dtype_code)
    t = CUDA_TYPES[dtype_code]
    table = (wants_gate_table(op, dtype_code, rows, hidden)
             and fits_smem(pipe_smem_bytes(team_log, np_, vec, glog, True), optin))
    lo = 4 if np_ == 1 else 7
    full = np_ <= 2 and hidden == (np_ * vec) << team_log and team_log in (lo, lo + 1)
    flag = "true" if saved else "false"
    if full and op == OP_RMS and glog == 0:
        np_r, tl_r = ((1, 8) if (np_, team_log) == (2, 7) and bwd_row_wide(rows, sm_count)
                      else (np_, team_log))
        return BackwardLaunch(f"normspec_bwd_row_kernel<{t}, {np_r}, {tl_r}, {flag}>", glog,
                              groups, False, (pipe_block(tl_r), 0, tl_r))
    block = pipe_block(team_log)
    if full and op == OP_GATED and dtype_code == DT_BF16 and np_ == 1 and saved and table:
        gc = gated_gc(hf, w_is_input)
        if glog >= 1 and offsets_fit_32(rows, hidden, strides):
            smem = (glog - 1) * vec * 4 * 256 + GATE_TABLE_SLOTS * 8
            name = f"normspec::normspec_gated_bwd_pair_kernel<{t}, {team_log}, {gc}>"
            return BackwardLaunch(name, glog, groups, True, (block, smem, team_log))
        return BackwardLaunch(f"normspec_bwd_pipe_kernel<{op}, {t}, 1, {team_log}, true, {gc}>",
                              glog, groups, True,
                              (block, pipe_smem_bytes(team_log, 1, vec, glog, True), team_log))
    name = (f"normspec_bwd_pipe_kernel<{op}, {t}, {np_}, "
            f"{team_log if full else -1}, {flag}, -1>")
    smem = pipe_smem_bytes(team_log, np_, vec, glog, table)
    return BackwardLaunch(name, glog, groups, table, (block, smem, team_log))


#: lanes (log2) a row of the quad forward, by the row's length (``quad_lanes_log``)
QUAD_LANES_LOG = {256: 6, 128: 5}


def quad_forward_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int,
                        w_raw: bool
                        ) -> tuple[str, tuple[int, int, int], tuple[int, int, int]] | None:
    """``(kernel name expression, grid, block)`` of the q/k forward in vectors of four
    (``normspec::launch_detail::launch_quad``) for aligned rows, ``None`` where it does not
    apply: rms and fused rows of 256 or 128 16-bit elements with a weight read as it is
    (`w_raw`), whose one-row forward would be one pass of 32 or 16 lanes, and whose
    four-element lanes number at most ``sm_count * 128``; 256-thread blocks."""
    ll = QUAD_LANES_LOG.get(hidden)
    if (ll is None or not w_raw or dtype_code == DT_F32 or op not in (OP_RMS, OP_FUSED)
            or rows << ll > sm_count * 128):
        return None
    if row_geometry(hidden, vec_of(dtype_code), op != OP_RMS, rows, sm_count) != (ll - 1, 1):
        return None
    return (f"normspec_fwd_quad_kernel<{op}, {CUDA_TYPES[dtype_code]}, {ll}>",
            (grid_for(rows, 256 >> ll), 1, 1), (256, 1, 1))


def row_default_np(op: int) -> int:
    return 4 if op == OP_RMS else 2


def row_forward_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int
                       ) -> tuple[str, tuple[int, int, int], tuple[int, int, int], int] | None:
    """``(kernel name expression, grid, block, team_log)`` of the one-row forward for
    aligned rows, ``None`` where it does not apply (rows longer than 1024 vectors).
    Rows that fill the team exactly run the constant-geometry form (``FULL_TL =
    team_log``, ``forward_row_t``): with the default passes (teams of 2..256 lanes) or
    with one pass (the small-row teams of 16..256 lanes)."""
    vec = vec_of(dtype_code)
    team_log, np_ = row_geometry(hidden, vec, op != OP_RMS, rows, sm_count)
    if np_ == 0:
        return None
    full = (row_index_fits_32(rows) and hidden == (np_ * vec) << team_log
            and ((np_ == row_default_np(op) and 1 <= team_log <= 8)
                 or (np_ == 1 and 4 <= team_log <= 8)))
    block = row_block(team_log, rows, sm_count)
    name = (f"normspec_fwd_row_kernel<{op}, {CUDA_TYPES[dtype_code]}, {np_}, "
            f"{team_log if full else -1}>")
    return name, (grid_for(rows, block >> team_log), 1, 1), (block, 1, 1), team_log


#: Team sizes (log2) of the one-row forward's forms that read act(z) from the global gate
#: table (``forward_row_with_global_table``: two passes, rows of 64..1024 bf16).
GLOBAL_TABLE_TEAM_LOGS = range(2, 7)
#: The kernel that fills the global gate table of one activation.
FILL_GATE_TABLE_KERNEL = "normspec_fill_gate_table_kernel<__nv_bfloat16>"


def gt_form(hf: bool, w_is_input: bool, w_raw: bool) -> int:
    """The GT forward's form (``normspec_fwd_row_kernel``'s ``GTF``; ``gt_form_of`` of the
    launcher): the vllm convention's own form 1, or 4 with the weight read in the input
    dtype (`w_raw`); the transformers convention's 2 (fp32 weight), 3 (a weight of the input
    dtype) or 5 (that weight read as it is, products in packed bf16)."""
    if not hf:
        return 4 if w_raw else 1
    if not w_is_input:
        return 2
    return 5 if w_raw else 3


def gated_row_table_launch(op: int, dtype_code: int, rows: int, hidden: int, sm_count: int,
                           *, hf: bool = False, w_is_input: bool = False, w_raw: bool = False
                           ) -> tuple[str, tuple[int, int, int], tuple[int, int, int], int] | None:
    """``(kernel name expression, grid, block, team_log)`` of the one-row forward that reads
    act(z) from the gate table in global memory (``GT``), for aligned bf16 gated launches
    of at least 2**20 elements whose rows fill a two-pass team of 4..64 lanes
    (``forward_row_with_global_table``), in the form ``gt_form(hf, w_is_input, w_raw)``;
    ``None`` elsewhere."""
    if not (wants_gate_table(op, dtype_code, rows, hidden) and row_index_fits_32(rows)):
        return None
    vec = vec_of(dtype_code)
    team_log, np_ = row_geometry(hidden, vec, True, rows, sm_count)
    if np_ != 2 or hidden != (np_ * vec) << team_log or team_log not in GLOBAL_TABLE_TEAM_LOGS:
        return None
    block = row_block(team_log, rows, sm_count)
    form = gt_form(hf, w_is_input, w_raw)
    name = f"normspec_fwd_row_kernel<{op}, {CUDA_TYPES[dtype_code]}, 2, {team_log}, true, {form}>"
    return name, (grid_for(rows, block >> team_log), 1, 1), (block, 1, 1), team_log


class ForwardPipeLaunch(NamedTuple):
    """The persistent pipelined forward's launch (``pipe_forward_launch``)."""

    name: str  # kernel name expression
    block: int  # threads per block
    smem: int  # dynamic shared memory: the weight factors, then the gate table
    team_log: int
    table: bool  # the per-block gate table (F_GATE_TABLE)


def pipe_forward_launch(op: int, dtype_code: int, rows: int, hidden: int, optin: int
                        ) -> ForwardPipeLaunch | None:
    """The persistent pipelined forward (``normspec_fwd_pipe_kernel``; ``forward_pipe_t``
    of the launcher) for aligned rows of at most 1024 vectors, ``None`` elsewhere. The
    launcher runs it where the one-row forward does not run: bf16 gated launches with a
    gate table (``wants_gate_table``) that the global table's forms do not take (rows that
    do not fill a two-pass team of 4..64 lanes, a stream being captured before the table's
    first fill). Each block builds the gate table in its shared memory where it fits; rows
    that fill a team of 4..32 lanes in one or two passes then run the constant-geometry
    form."""
    vec = vec_of(dtype_code)
    team_log, np_ = pipe_forward_geometry(hidden, vec)
    if np_ == 0:
        return None
    weights = (np_ * vec * 4) << team_log
    table = (wants_gate_table(op, dtype_code, rows, hidden)
             and fits_smem(weights + GATE_TABLE_SLOTS * 4, optin))
    full = table and np_ <= 2 and hidden == (np_ * vec) << team_log and 2 <= team_log <= 5
    name = (f"normspec_fwd_pipe_kernel<{op}, {CUDA_TYPES[dtype_code]}, {np_}, "
            f"{team_log if full else -1}>")
    return ForwardPipeLaunch(name, pipe_block(team_log),
                             weights + (GATE_TABLE_SLOTS * 4 if table else 0), team_log, table)


def forward_launch(op: int, dtype_code: int, rows: int, hidden: int
                   ) -> tuple[str, tuple[int, int, int], tuple[int, int, int]]:
    """``(kernel name expression, grid, block)`` of the register or streaming forward."""
    threads, np_ = forward_geometry(hidden, vec_of(dtype_code))
    t = CUDA_TYPES[dtype_code]
    if np_ == 0:
        return f"normspec_fwd_stream_kernel<{op}, {t}>", (grid_for(rows, 1), 1, 1), (1024, 1, 1)
    tpb = 4 if threads == 32 else 1
    return (f"normspec_fwd_kernel<{op}, {t}, {np_}>", (grid_for(rows, tpb), 1, 1),
            (threads, tpb, 1))


def backward_launch(op: int, dtype_code: int, rows: int, hidden: int, groups: int
                    ) -> tuple[str, tuple[int, int, int], tuple[int, int, int], bool]:
    """``(kernel name expression, grid, block, takes glog)`` of the backward."""
    threads, np_ = backward_geometry(hidden, vec_of(dtype_code))
    t = CUDA_TYPES[dtype_code]
    if np_ == 0:
        return (f"normspec_bwd_stream_kernel<{op}, {t}>", (grid_for(rows, 1), 1, 1),
                (1024, 1, 1), False)
    tpb = 4 if threads == 32 else 1
    return (f"normspec_bwd_kernel<{op}, {t}, {np_}>", (grid_for(groups, tpb), 1, 1),
            (threads, tpb, 1), True)


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
