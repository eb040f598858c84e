"""Small work for ``compute-sanitizer`` over the torch extension's CUDA kernels.

``scripts/gpu_evidence.sh racecheck`` runs this script under ``compute-sanitizer --tool
racecheck`` and ``--tool synccheck`` (kernels named ``normspec*`` only). The racecheck tool
reports shared-memory hazards: two accesses to one address, one a write, with no barrier
between them. The cases reach every kernel form that shares memory across warps:

* teams of one block (64 to 256 lanes): the one-row forward and backward of 2048-wide rows
  (one pass or four), whose warp partials meet in shared memory (``team_reduce_pipe``);
* the pipelined backward over many rows, with the forward's rstd (``SAVED``: one reduction a
  row, in alternating halves of its buffer) and without it (two);
* rows that do not fill a team (the forms whose team size is read at run time);
* the fused and gated norms, the gated ones with the gate table in shared or global memory.

Each case runs the forward with its rstd and then both backwards (reading that rstd, and
recomputing it) once; sizes are small, since the tools slow kernels down by a factor of 10 to
100. Prints one line per case. Usage (CUDA GPU, repository root):
``compute-sanitizer --tool racecheck --kernel-name kns=normspec python3 scripts/sanitize_small.py``.
"""

from __future__ import annotations

import argparse
import time

import torch

EPS = 1e-6

#: (op, rows, hidden, dtype, parameters)
CASES: tuple[tuple[str, int, int, torch.dtype, dict], ...] = (
    ("rms_norm", 1, 2048, torch.bfloat16, {"offset": 1.0}),
    ("rms_norm", 64, 2048, torch.bfloat16, {"offset": 1.0}),
    ("rms_norm", 4096, 2048, torch.bfloat16, {"offset": 1.0}),
    ("rms_norm", 4096, 1000, torch.bfloat16, {"offset": 1.0}),
    ("rms_norm", 4096, 256, torch.bfloat16, {"offset": 1.0}),
    ("rms_norm", 64, 2048, torch.float32, {"offset": 0.0}),
    ("fused_add_rms_norm", 4096, 2048, torch.bfloat16,
     {"offset": 1.0, "residual_sum": "rounded"}),
    ("rms_norm_gated", 8192, 128, torch.bfloat16, {"convention": "vllm", "activation": "silu"}),
    ("rms_norm_gated", 8192, 128, torch.bfloat16, {"convention": "hf", "activation": "silu"}),
    ("rms_norm_gated", 64, 256, torch.bfloat16, {"convention": "hf", "activation": "sigmoid"}),
)


def run_case(op: str, rows: int, hidden: int, dtype: torch.dtype, params: dict,
             g: torch.Generator) -> None:
    """The forward with its rstd, then the backward with that rstd and without it, on
    `g`'s device (the CPU kernels take the same calls)."""
    ops = torch.ops.normspec

    def rand() -> torch.Tensor:
        return torch.randn(rows, hidden, device=g.device, generator=g).to(dtype)

    x, dy = rand(), rand()
    w = (0.1 * torch.randn(hidden, device=g.device, generator=g)).to(dtype)
    if op == "rms_norm":
        _, rstd = ops.rms_norm_with_rstd(x, w, EPS, params["offset"])
        for saved in (rstd, None):
            ops.rms_norm_backward(dy, x, w, EPS, params["offset"], saved)
    elif op == "fused_add_rms_norm":
        r, dres = rand(), rand()
        *_, rstd = ops.fused_add_rms_norm_with_rstd(x, r, w, EPS, params["offset"],
                                                    params["residual_sum"])
        for saved in (rstd, None):
            ops.fused_add_rms_norm_backward(dy, dres, x, r, w, EPS, params["offset"],
                                            params["residual_sum"], saved)
    else:
        z = rand()
        _, rstd = ops.rms_norm_gated_with_rstd(x, z, w, EPS, params["convention"],
                                               params["activation"])
        for saved in (rstd, None):
            ops.rms_norm_gated_backward(dy, x, z, w, EPS, params["convention"],
                                        params["activation"], saved)
    if g.device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize_small: needs a CUDA GPU")
        return 2
    from normspec.backends import torch_ext as te

    te.build(verbose=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    for op, rows, hidden, dtype, params in CASES:
        start = time.perf_counter()
        run_case(op, rows, hidden, dtype, params, g)
        shown = ", ".join(f"{k}={v}" for k, v in params.items())
        print(f"{op} {rows} x {hidden} {str(dtype).removeprefix('torch.')} ({shown}): "
              f"forward and both backwards in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
