"""Where does the CuPy backend's host time per call go?

The bench at fe840bd (bench/results/sweeps/cupy_pipe_backward.json) put the CuPy
backend's host time per call at 200-400 us for a forward and 800-1100 us for a backward
(the torch extension: 20-130 us), so at up to 32768 x 2048 rows its calls are host-bound
although its kernels are within 5-15 % of the extension's. This script enqueues the same
calls many times without waiting for the GPU and reports, per path, the host time per
call and cProfile's top functions by own time:

* ``forward``: ``cupy_backend.rms_norm`` without autograd;
* ``backward (explicit)``: ``cupy_backend.rms_norm_backward`` on the calling thread;
* ``backward (autograd)``: ``torch.autograd.grad`` through the backend's autograd
  function, as the bench times it (the backward then runs on autograd's device thread,
  which cProfile does not see: compare its host time with the explicit one).

Usage (a CUDA machine with CuPy): ``python3 scripts/cupy_host_profile.py [--rows R]
[--hidden H] [--calls N] [--top K] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from collections.abc import Callable

import torch

# this script's folder is on sys.path when it runs: one host timer for the probes
from placement_probe import host_us

EPS = 1e-6


def top_functions(fn: Callable[[], object], calls: int, top: int) -> tuple[str, list[dict]]:
    """cProfile of ``calls`` calls: the printed table and its rows (own time first)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("tottime")
    stats.print_stats(top)
    rows = []
    for (path, line, name), (_cc, ncalls, tottime, cumtime, _callers) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append({"function": f"{path}:{line}({name})", "calls": ncalls,
                     "own_us_per_call": tottime / calls * 1e6,
                     "cum_us_per_call": cumtime / calls * 1e6})
    return buf.getvalue(), rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    from normspec.backends import cupy_backend as cb

    why = cb.available()
    if why is not None:
        raise SystemExit(f"cupy backend unavailable: {why}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.rows, args.hidden, device="cuda", generator=gen).bfloat16()
    w = (0.1 * torch.randn(args.hidden, device="cuda", generator=gen)).bfloat16()
    dy = torch.randn_like(x)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = cb.rms_norm(xl, wl, eps=EPS)

    def forward():
        with torch.no_grad():
            return cb.rms_norm(x, w, eps=EPS)

    paths = {
        "forward": forward,
        "backward (explicit)": lambda: cb.rms_norm_backward(dy, x, w, eps=EPS),
        "backward (autograd)": lambda: torch.autograd.grad(y, (xl, wl), dy, retain_graph=True),
    }
    report = {"rows": args.rows, "hidden": args.hidden, "calls": args.calls, "paths": {}}
    for name, fn in paths.items():
        us = host_us(fn, args.calls)
        table, rows = top_functions(fn, args.calls, args.top)
        report["paths"][name] = {"host_us_per_call": us, "top": rows}
        print(f"==== {name}: {us:.1f} us host per call\n{table}")
    print(f"{'path':<22}{'host us/call':>14}")
    for name, r in report["paths"].items():
        print(f"{name:<22}{r['host_us_per_call']:>14.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
