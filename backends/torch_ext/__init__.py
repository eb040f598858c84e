"""``normspec.backends.torch_ext``: first-party C++/CUDA kernels as torch operators.

The operators ``torch.ops.normspec.*`` (schemas declared once in
``csrc/normspec_ops.cpp``; CPU kernels in ``normspec_cpu.cpp``; CUDA kernels in
``normspec_pipe.cuh`` and ``normspec_kernels.cuh``, launched by
``normspec_launch.cu`` from ``normspec_cuda.cpp``) are bitwise equal to the
spec, forward and backward. The extension is compiled on first use (or ahead
of time by ``normspec build``; the kernels of each op, direction and dtype are a
translation unit of their own, ``csrc/launch_units/*.cu``, compiled side by side)
and cached.

CUDA kernels. Rows that are 16-byte aligned (pointer and row stride) and at most
1024 vectors long (8192 bf16/fp16 or 4096 fp32 elements) run on the *pipelined*
kernels. The forward gives each team one row and no loop (the block scheduler
streams the rows; weight factors from L1). A
launch too small to fill the GPU gets wider teams, down to one vector per thread, so
that one row's latency is shorter: the team doubles while the teams' threads stay
within half the device's resident threads (on an H200, rows of 2048 bf16 run 64
lanes from 1057 rows on, 128 from 529 and 256 below). The backward runs persistent
teams that keep the weight factors in shared memory, load the next row while reducing
the current one, and keep the dweight stacks in shared memory. Large bf16 gated
launches (at least 2**20 elements) read the gate's activation from a table for the
8192 bf16 gates with magnitude in [2**-24, 2**8), evaluated with the declared
functions themselves, and evaluate the other gates directly. The forward's table lives
in global memory, filled once per process and device (on an H200, 2**21 x 128: 372 us
against 394 with the persistent kernel's table per block, which a first use inside a
CUDA graph capture still takes); the backward evaluates the activation and its
derivative once per block into a shared-memory table. Their
backward with the forward's rstd, on rows of 128 and 256 (the GDN norm's head sizes),
runs kernels with the convention (vLLM, transformers with an fp32 weight or with a
weight of the input dtype) as a compile-time constant and one table lookup per vector
(on an H200, 2**21 x 128: 821 us against 939 before); where its dweight groups have two
rows or more (large launches), a kernel of its own that takes two rows a team per
iteration (698 us against 766). Other rows (unaligned views,
longer rows) run on the register and streaming kernels. The CuPy backend launches all
of these kernels the same way (its launcher mirrors this one's in Python, and
tests/test_cupy_launch_parity.py holds the two to the same launches), but for the
chained tree launches, which it makes as plain ones. Every geometry gives
the same bits; these variables only change speed (read once per process):

* ``NORMSPEC_PIPE=0``: never use the pipelined kernels;
* ``NORMSPEC_FWD_ROW=0``: the persistent forward instead of one row per team;
* ``NORMSPEC_FWD_TEAM`` / ``NORMSPEC_BWD_TEAM``: threads per row (a power of two;
  1..256 for the pipelined kernels, 32 and more for the register kernels);
* ``NORMSPEC_BWD_GLOG``: rows per dweight group of the pipelined backward (log2, 0..7,
  at most the rows' next power of two and what shared memory holds; the plan itself
  goes to 5, within 40 KiB of stacks per block);
* ``NORMSPEC_GATE_TABLE=0``: no activation table (every gate evaluated);
* ``NORMSPEC_FULL_ROW=0``: no constant-geometry kernels (the general ones also
  for rows that fill the team exactly; the CuPy backend's forward reads it too);
* ``NORMSPEC_GATED_ROW_TABLE=0``: large bf16 gated forwards of 64..1024-element rows
  run the persistent kernel with a gate table per block in shared memory, instead of
  one row per team reading act(z) from a gate table in global memory that is filled
  once per process and device (the CuPy backend then runs the one-row forward that
  evaluates every gate);
* ``NORMSPEC_TREE_LAST=0``: dweight's workspace tree folded by levels of 16 rows down
  to one row and then cast, instead of a last launch that folds up to 256 rows and
  casts (the torch extension only);
* ``NORMSPEC_DW_FINAL=0``: where the pipelined backward has one dweight group (one
  row) of a 16-bit input whose weight has its dtype, the workspace row and a cast
  launch, instead of the backward kernel storing dweight itself (the CuPy backend
  reads it too);
* ``NORMSPEC_PDL=0``: dweight's tree launches wait for the kernel before them to end
  before they start, instead of starting early and waiting on the GPU (programmatic
  dependent launch, compute capability 9.0 and later, never inside a CUDA graph
  capture; the CuPy backend reads it too);
* ``NORMSPEC_SAVED_RSTD=0``: the pipelined backward recomputes rstd even where the
  forward's is given;
* ``NORMSPEC_ROW_BLOCK``: threads per block of the one-row forward where its teams
  have at most 32 lanes (a power of two, 32..256; default 256, or one warp for
  launches of at least 8 waves of the device's resident threads);
* ``NORMSPEC_ROW_QUAD=0``: the rms and fused forwards of few 16-bit rows of 256 or 128
  elements (at most 128 threads an SM: 256 rows of 256 or 512 of 128 on an H200) with
  a weight of the input dtype run the one-pass form of 32- or 16-lane teams, eight
  elements a lane, instead of ``normspec_fwd_quad_kernel``'s four a lane (two warps a
  row of 256; on an H200, 64 x 256 bf16 forward kernels: 1.18 us against 1.22 warm,
  1.28 against 1.39 after an L2 flush; the CuPy backend reads it too);
* ``NORMSPEC_ROW_BLOCK_SPREAD=1`` (an experiment, off by default): where those teams
  would fill fewer 256-thread blocks than the device has SMs (64 x 256 bf16: yes,
  4096 x 256: no), 64-thread blocks, so that few rows spread over more SMs (the CuPy
  backend reads it too); one micro-harness sweep had it faster, three processes
  through this extension did not (notes/perf.md §36);
* ``NORMSPEC_BWD_ROW=0``: rms backward launches of full rows whose plan gives every
  row a dweight group of its own (launches too small to fill the GPU, such as
  1 x 2048 or 4096 x 256) run the pipelined kernel instead of the one-row kernel,
  which gives each team one row, no loop and no shared-memory stacks (on an H200,
  1 x 2048 bf16: one 1.63 us kernel against 1.92-1.98);
* ``NORMSPEC_BWD_ROW_WIDE=0``: that one-row kernel, for rows of 256 vectors (2048
  bf16 or fp16, 1024 fp32), runs as 128 threads of two vectors each instead of 256
  threads of one (taken while the launch's blocks fit the GPU at once: at most 8 per
  SM), which halves the instructions of each warp on the few-row chain (on an H200,
  1 x 2048 bf16 backward: 3.74-3.87 us against 3.62-3.68 in the micro harness);
  ``NORMSPEC_BWD_ROW_WIDE=2`` (an experiment, off by default) takes the 256-thread
  form past that bound too, wherever every row has a dweight group of its own (on an
  H200 mixed there: 1400 x 2048 slower, 2000 x 2048 faster, by 1-2 %);
* ``NORMSPEC_GT_VLLM_FORM=0``: the large bf16 gated forward of the vLLM convention
  runs the form it shares with the transformers convention (which keeps the unpacked
  input in registers through the row's reduction) instead of its own (which unpacks
  the raw input again; on an H200, 2**21 x 128: 376 us against 378);
* ``NORMSPEC_GT_HF_FORM=0``: the large bf16 gated forward of the transformers
  convention runs the form it shares with the vLLM convention (flags read at run time)
  instead of its own (the convention and the weight's dtype as compile-time constants;
  on an H200, 2**21 x 128: 378.3-378.8 us against 379.6-379.7);
* ``NORMSPEC_GT_VLLM_W_RAW=0``: the vLLM convention's own form, for a weight of the
  input dtype that the kernel reads as it is, no longer takes that as a compile-time
  constant, so the fp32 weight's load path stays in the kernel (on an H200,
  2**21 x 128: 375.7-376.3 us against 375.2-375.3);
* ``NORMSPEC_GT_HF_PACKED_W=0``: the transformers convention's own form, for a bf16
  weight that the kernel reads as it is, multiplies the rounded normalized input by the
  weight in fp32 with a rounding after, instead of two values at a time in bf16 (each
  product rounded once, the same bits; on an H200, 2**21 x 128: 379.2-380.3 us against
  374.4-374.7);
* ``NORMSPEC_GATED_BWD_PACKED_W=0``: the large bf16 gated backward of the transformers
  convention with a bf16 weight takes its two products with the weight (the weighted
  output for dgate, and dxhat) in fp32 with a rounding after, instead of two values at
  a time in bf16, each rounded once (the same bits; on an H200, 2**21 x 128:
  778.9-779.8 us against 775.4-776.5);
* ``NORMSPEC_GATED_BWD_PAIR=0``: that backward (rows of 128 and 256, the forward's
  rstd, dweight groups of at least two rows) runs the pipelined kernel's
  convention-constant forms, one row a team per iteration, instead of
  ``normspec_gated_bwd_pair_kernel`` (``normspec_gated_bwd.cuh``), which takes two rows
  a team per iteration, adds their dweight contributions in registers, keeps the
  weight in registers and does its row arithmetic in 32 bits (the same bits; on an
  H200, 2**21 x 128 in the micro harness: 698 us against 766 for the vLLM convention,
  700 against 773 for the transformers one). The CuPy backend reads these backward
  switches, ``NORMSPEC_SAVED_RSTD``, ``NORMSPEC_BWD_ROW``, ``NORMSPEC_BWD_ROW_WIDE`` and
  the ``NORMSPEC_GT_*`` switches too, at each call.

Build-time experiments go through ``NORMSPEC_BUILD_DEFINES`` (space-separated ``NAME`` or
``NAME=VALUE``, passed as ``-D`` flags to every source; such a build is cached in a
directory of its own), e.g. ``NORMSPEC_BUILD_DEFINES=NORMSPEC_ROW_WEIGHT_EARLY=0``: the
one-row forward's rms and fused forms of more than one pass load a 16-bit weight after
the reduction, as before 71f0ae0, instead of with the row (the same bits; on an H200,
fused 4096 x 2048 after the 512 MiB flush: 20.8 us against 20.0, rms 4096 x 2048:
12.8 against 12.5). ``NORMSPEC_BLOCK_FOLD_LOCAL=0`` folds the per-warp partials of a
team of 64 and more lanes by shuffles and a broadcast instead of in every lane from
shared memory, and ``NORMSPEC_FWD_ROW_PER_BLOCK=0`` has the one-row forward's whole-block
teams take their row from the thread index instead of ``blockIdx.x`` (both the same
bits; on an H200 with both, in ``bench/micro/small_backward_ab.cu`` after the 512 MiB
flush, the rms forward of 1 x 2048 took 3.87 us against 3.68, 64 x 2048 4.19 against 3.84
and 4096 x 2048 12.54 against 11.74). ``NORMSPEC_BWD_PIN_OCCUPANCY=0`` lifts the cap of
80 registers on two backward forms, which nvcc reaches by itself and NVRTC does not
(without it the CuPy backend's binaries hold one block per SM less: on an H200 its fused
32768 x 256 backward took 38.2 us against 35.2; notes/perf.md §45). The CuPy backend
gives NVRTC the same definitions (``normspec.backends.build_defines``).

The saved rstd. When autograd records a call (grad enabled and an input that
requires grad), the Python functions run ``torch.ops.normspec.*_with_rstd``,
which also return rstd (fp32, one value per row, 4 bytes a row), and the
backward operators receive it (their optional last argument ``rstd``). The
spec fixes rstd's bits, so reading it gives the same gradients as recomputing
it; the pipelined CUDA backward then skips the row's first reduction, its square
root and division (and a barrier per row for teams of more than one warp).
Without autograd the plain forward runs and no rstd is written.

The fused op's saved sum. Where the new residual is the very sum the norm read
(``residual_sum="rounded"``, or float32 rows, where both conventions coincide),
autograd saves it instead of ``x`` and ``residual`` (one activation row tensor
instead of two), and its backward runs
``torch.ops.normspec.fused_add_rms_norm_backward_from_sum``: it reads that sum
instead of recomputing it from two rows and writes one gradient row, which is
both ``dx`` and ``dresidual`` (the spec makes them equal; autograd receives the
same tensor for both inputs). A 16-bit ``"fp32"`` norm reads the unrounded sum,
which the new residual does not hold: it keeps the backward from ``x`` and
``residual``.

Python API (validation errors are the spec's):

* [`rms_norm`][normspec.backends.torch_ext.rms_norm]`(x, weight, *, eps, offset=0.0)`
* [`fused_add_rms_norm`][normspec.backends.torch_ext.fused_add_rms_norm]`(x, residual,
  weight, *, eps, offset=0.0, residual_sum="fp32") -> (y, new_residual)`
* [`rms_norm_gated`][normspec.backends.torch_ext.rms_norm_gated]`(x, gate, weight, *,
  eps, convention="vllm", activation="silu")`
* [`build`][normspec.backends.torch_ext.build]`(verbose=True)`,
  [`available`][normspec.backends.torch_ext.available]`() -> str | None`
"""

from __future__ import annotations

from ._build import CSRC, available, build, build_directory, cuda_build_possible, loaded
from ._ops import fused_add_rms_norm, rms_norm, rms_norm_gated
from .backend import backend

__all__ = [
    "CSRC",
    "available",
    "backend",
    "build",
    "build_directory",
    "cuda_build_possible",
    "fused_add_rms_norm",
    "loaded",
    "rms_norm",
    "rms_norm_gated",
]
