"""Where does the rms backward's time go: the GPU, the host, or memory placement?

The bf16 rms backward at 32768 x 2048 looked bimodal across processes in the bench (same
build, same inputs: about 135-150 us in some runs and 200-220 us in others; torch.compile's
backward showed the same spread). This probe times it on fresh allocations within one
process: before every trial the allocator's cache is emptied and a spacer of random size
is allocated first, so x, dy and the op's outputs land on other memory. Per trial and
backend (ours and torch.compile's) it prints do_bench's time, the host time to enqueue one
call (no sync, no flush) and the GPU's kernel time per call (CUPTI, gaps excluded), then a
same-bytes device copy, and writes the trials as JSON (``--out``).

On the H200 (bench/results/probes/placement_H200.json) the kernel times did not move with
placement (ours 121.9-123.6 us, torch.compile's 124.3-125.1) while the host time per call
did (244-385 and 400-577 us): the spread is the host's, which do_bench counts whenever
the host needs longer than its L2 flush. bench/device_timing.py times the GPU alone."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

ROWS, HIDDEN, EPS = 32768, 2048, 1e-6
BF16 = torch.bfloat16


def bench_us(fn, rep_ms: float) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=rep_ms, return_mode="median") * 1e3


def host_us(fn, calls: int = 50) -> float:
    """Host time per call when the GPU never makes the host wait (no flush, no sync)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def kernel_us(fn, calls: int = 10) -> float:
    """GPU time per call: the sum of the kernels' durations (CUPTI), gaps excluded."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / calls


def backward_call(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """dx and dweight of ``fn`` at (x, w), the graph built once."""
    leaf = x.detach().requires_grad_()
    y = fn(leaf)
    return lambda: torch.autograd.grad(y, [leaf, w], dy, retain_graph=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the trials")
    args = p.parse_args(argv)

    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from normspec.backends import torch_ext as te

    te.build(verbose=False)
    rng = random.Random(args.seed)
    w = (0.1 * torch.randn(HIDDEN, device="cuda")).to(BF16).requires_grad_()
    module = Qwen3NextRMSNorm(HIDDEN, eps=EPS).to("cuda", BF16)
    compiled = torch.compile(module)
    peers = {  # name: (function of x, the weight it uses)
        "torch_ext": (lambda t: te.rms_norm(t, w, eps=EPS, offset=1.0), w),
        "torch.compile": (compiled, module.weight),
    }
    trials = []
    print(f"{'trial':>5} {'spacer MiB':>10} {'torch_ext':>10} {'host':>6} {'kernels':>7} "
          f"{'compile':>9} {'host':>6} {'kernels':>7} {'copy':>7}", flush=True)
    for i in range(args.trials):
        torch.cuda.empty_cache()
        spacer_mib = rng.choice([0, 2, 6, 30, 126, 254, 510]) + rng.randrange(0, 64) * 2
        spacer = torch.empty(spacer_mib << 20, dtype=torch.uint8, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(ROWS, HIDDEN, device="cuda", generator=g).to(BF16)
        dy = torch.randn(ROWS, HIDDEN, device="cuda", generator=g).to(BF16)
        row = {"trial": i, "spacer_mib": spacer_mib,
               "x_ptr": x.data_ptr(), "dy_ptr": dy.data_ptr()}
        for name, (fn, weight) in peers.items():
            call = backward_call(fn, x, weight, dy)
            row[name + "_us"] = bench_us(call, args.rep_ms)
            row[name + "_host_us"] = host_us(call)
            row[name + "_kernels_us"] = kernel_us(call)
        # the backward's bytes: reads x and dy, writes dx (three tensors); a copy of
        # one and a half tensors reads and writes the same total
        n = 3 * ROWS * HIDDEN // 2
        src = torch.empty(n, dtype=BF16, device="cuda")
        dst = torch.empty(n, dtype=BF16, device="cuda")
        row["copy_us"] = bench_us(lambda d=dst, s=src: d.copy_(s), args.rep_ms)
        trials.append(row)
        ours, tc = "torch_ext", "torch.compile"
        print(f"{i:>5} {spacer_mib:>10} {row[ours + '_us']:>10.1f} {row[ours + '_host_us']:>6.1f} "
              f"{row[ours + '_kernels_us']:>7.1f} {row[tc + '_us']:>9.1f} "
              f"{row[tc + '_host_us']:>6.1f} {row[tc + '_kernels_us']:>7.1f} "
              f"{row['copy_us']:>7.1f}", flush=True)
        del spacer, x, dy, src, dst
    for key in trials[0]:
        if not key.endswith("_us"):
            continue
        vals = sorted(r[key] for r in trials)
        print(f"{key:>16}: min {vals[0]:.1f}  median {statistics.median(vals):.1f}  "
              f"max {vals[-1]:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "shape": [ROWS, HIDDEN],
                       "command": " ".join(["python3", *sys.argv]), "trials": trials},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
