"""The CuPy backend's launch plan is the torch extension's.

Both CUDA backends launch what one plan says: ``backends/csrc/normspec_plan.h`` in C++
(the torch extension's launcher) and its twin ``normspec.backends.cupy.planner`` (with
``geometry``). tests/plan_table.cpp, built here with the host's C++ compiler, prints the
C++ plan for a table of queries, and the Python plan must give the same line for each:
the backward's dweight groups, the kernel family and template arguments, block, shared
memory, grid (or the persistent grid for a given occupancy). The table holds every row
length threshold of the geometries (one element either side) per dtype; row counts of one,
around 8 x SMs, at the gate table's 2**20-element cutoff and around 2**31; SMs 1, 108 and
132; 48, 100 and 227 KiB of opt-in shared memory; and every combination of the query's
flags on the shapes where the forms that read them live.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest

from normspec.backends.cupy import name_expressions
from normspec.backends.cupy.codes import DT_BF16, DT_F16, DT_F32
from normspec.backends.cupy.geometry import backward_plan_aligned
from normspec.backends.cupy.launches import kernel_name
from normspec.backends.cupy.planner import LaunchPlan, PlanQuery, launch_plan, persistent_grid

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
SMS = (1, 108, 132)
OPTINS = (48 * 1024, 100 * 1024, 227 * 1024)
#: (op, backward): the forwards of the three ops, the backwards of the four
DIRECTIONS = ((0, False), (1, False), (2, False), (0, True), (1, True), (2, True), (3, True))
#: the query's flags, in PlanQuery's order
FLAGS = ("aligned", "w_raw", "hf", "w_is_input", "saved_rstd", "global_table",
         "offsets_fit_32")


@pytest.fixture(scope="module")
def plan_table(tmp_path_factory) -> Path:
    """tests/plan_table.cpp, built with the host's C++ compiler (no CUDA needed)."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("plan_table") / "plan_table"
    done = subprocess.run([CXX, "-std=c++17", "-O1", "-I", str(ROOT / "backends" / "csrc"),
                           str(ROOT / "tests" / "plan_table.cpp"), "-o", str(exe)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return exe


def hidden_sizes(vec: int) -> list[int]:
    """Row lengths around every vector-count threshold of the geometries (one element
    either side), for ``vec`` elements a vector."""
    out = {1, 7, 100}
    for nvec in (1 << k for k in range(13)):
        out |= {nvec * vec - 1, nvec * vec, nvec * vec + 1}
    return sorted(h for h in out if h > 0)


def row_counts(hidden: int) -> list[int]:
    """One row, a few, the gate table's 2**20-element cutoff and 2**31 (either side)."""
    cutoff = -(-(1 << 20) // hidden)
    return sorted({1, 3, cutoff - 1, cutoff, 2**31 - 1, 2**31} - {0})


def device_row_counts(sms: int) -> list[int]:
    """SMs x 2**k rows and one more (k = 1..14): the bounds of the q/k forward, the wide
    one-row backward (8 x SMs), the one-row forward's team widening and one-warp blocks and
    the pipelined backward's groups all lie on them."""
    return sorted({r for k in range(1, 15) for r in ((sms << k), (sms << k) + 1)})


#: flag sets of the threshold table: a call of the weight's dtype reading the saved rstd,
#: an unaligned one, the hf convention with an fp32 weight
FLAG_SETS = (dict(aligned=True, w_raw=True, w_is_input=True, saved_rstd=True), dict(),
             dict(aligned=True, hf=True))


def threshold_queries() -> list[PlanQuery]:
    """Every op, direction, dtype and device: each threshold row length with row counts of
    its own, and a few row lengths with each device's row-count bounds."""
    out = []
    for (op, bwd), dt, sms, optin in itertools.product(DIRECTIONS, (DT_F32, DT_BF16, DT_F16),
                                                       SMS, OPTINS):
        vec = 4 if dt == DT_F32 else 8
        shapes = [(h, r) for h in hidden_sizes(vec) for r in row_counts(h)]
        shapes += [(h, r) for h in (vec, 8 * vec, 128, 256, 1000, 256 * vec)
                   for r in device_row_counts(sms)]
        for (hidden, rows), flags in itertools.product(shapes, FLAG_SETS):
            out.append(PlanQuery(op, dt, bwd, rows, hidden, sms=sms, smem_optin=optin,
                                 **flags))
    return out


def flag_queries() -> list[PlanQuery]:
    """Every combination of the flags, on the shapes of the forms that read them: the
    q/k forward and one-row backward (128, 256), the gate tables (128 x 2**13 and
    2**21 rows), the two-pass constant forms (2048); a device of each size."""
    out = []
    for (op, bwd), dt, (sms, optin), hidden, rows in itertools.product(
            DIRECTIONS, (DT_F32, DT_BF16, DT_F16), zip(SMS, OPTINS, strict=True),
            (128, 256, 2048), (1, 8192, 2**21)):
        for bits in itertools.product((False, True), repeat=len(FLAGS)):
            out.append(PlanQuery(op, dt, bwd, rows, hidden, sms=sms, smem_optin=optin,
                                 **dict(zip(FLAGS, bits, strict=True))))
    return out


def query_line(q: PlanQuery) -> str:
    flags = " ".join(str(int(getattr(q, f))) for f in FLAGS)
    return f"{q.op} {q.dtype} {int(q.backward)} {q.rows} {q.H} {flags} {q.sms} {q.smem_optin}"


def python_plan(q: PlanQuery) -> tuple[PlanQuery, LaunchPlan]:
    """The query with its backward's dweight groups, and its Python plan."""
    if q.backward:
        q = q._replace(groups=backward_plan_aligned(q.dtype, q.rows, q.H, q.aligned, q.sms,
                                                    q.smem_optin))
    return q, launch_plan(q)


def python_line(q: PlanQuery, p: LaunchPlan) -> str:
    """What tests/plan_table.cpp prints for ``q``, from the Python plan ``p``."""
    fields = (*q.groups, p.kernel, p.np, p.full_tl, p.gt_form, p.gc, int(p.saved), p.block_x,
              p.block_y, p.smem, p.team_log, p.glog, p.groups, int(p.table),
              int(p.persistent), p.grid, p.units, persistent_grid(p, 3, q.sms))
    return " ".join(map(str, fields))


def cpp_lines(plan_table: Path, queries: list[PlanQuery]) -> list[str]:
    done = subprocess.run([str(plan_table)], input="\n".join(map(query_line, queries)) + "\n",
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


@pytest.mark.parametrize("table", [threshold_queries, flag_queries],
                         ids=["thresholds", "flags"])
def test_python_plan_is_the_cpp_plan(plan_table, table):
    """Query by query, the same line; and every kernel a plan names is one that its
    NVRTC module instantiates."""
    queries = table()
    want = cpp_lines(plan_table, queries)
    assert len(want) == len(queries)
    mismatches, kernels = [], set()
    for query, line in zip(queries, want, strict=True):
        q, p = python_plan(query)
        got = python_line(q, p)
        if got != line:
            mismatches.append(f"{query_line(q)}\n  C++:    {line}\n  Python: {got}")
        kernels.add((q.op, q.dtype, kernel_name(q.op, q.dtype, p)))
    assert not mismatches, (f"{len(mismatches)} of {len(queries)} queries plan "
                            "differently:\n" + "\n".join(mismatches[:12]))
    missing = [k for k in sorted(kernels) if k[2] not in name_expressions(k[0], k[1])]
    assert not missing, missing[:12]
