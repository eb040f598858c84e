"""Does the gated forward's time (2^21 x 128 bf16, no grad) depend on where x and the gate
lie? The bench allocates them back to back (randn, then randn); the harness allocates x,
out, weight, gate. Times ours (vllm, hf), FLA and torch.compile with the bench's own
time_call (do_bench and the device timing), interleaved over rounds, per layout.

Usage (GPU, from the repository root): ``python3 bench/micro/gated_layout.py``; ``ROUNDS``
sets the rounds (3), and the JSON goes to ``$OUT/gated_layout.json`` (``/tmp`` without
``OUT``). Session 19 (notes/perf.md §24): no layout moved any backend by more than 1 us."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import run as br  # bench/run.py: the peers, time_call, interleaved_rounds

br.BACKEND_FILTER = ["torch_ext", "compile", "fla"]
ROWS, H = 2**21, 128
N = ROWS * H
MIB = 2**20 // 2  # bf16 elements per MiB


def layout(name):
    g = torch.Generator(device="cuda").manual_seed(0)
    keep = []
    if name == "adjacent":  # the bench's: x then z
        x = torch.randn(ROWS, H, device="cuda", generator=g).to(torch.bfloat16)
        z = torch.randn(ROWS, H, device="cuda", generator=g).to(torch.bfloat16)
    elif name == "spacer":  # the harness's order: x, a buffer of the output's size, z
        x = torch.randn(ROWS, H, device="cuda", generator=g).to(torch.bfloat16)
        keep.append(torch.empty(N, dtype=torch.bfloat16, device="cuda"))
        z = torch.randn(ROWS, H, device="cuda", generator=g).to(torch.bfloat16)
    elif name == "z_plus_1mib":  # the gate 1 MiB + 4 KiB further on
        x = torch.randn(ROWS, H, device="cuda", generator=g).to(torch.bfloat16)
        pad = MIB + 2048
        buf = torch.empty(N + pad, dtype=torch.bfloat16, device="cuda")
        buf[pad:].copy_(torch.randn(N, device="cuda", generator=g).to(torch.bfloat16))
        z, keep = buf[pad:].view(ROWS, H), [buf]
    else:
        raise SystemExit(name)
    return x, z, keep


def main():
    rounds = int(os.environ.get("ROUNDS", "3"))
    out = {}
    for name in ("adjacent", "spacer", "z_plus_1mib"):
        torch._dynamo.reset()
        x, z, keep = layout(name)
        g = torch.Generator(device="cuda").manual_seed(1)
        weight = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
        peers = {k: v for k, v in br.peers_gated(weight).items()
                 if "eager" not in k and "cupy" not in k}
        print(name, "x", hex(x.data_ptr()), "z", hex(z.data_ptr()),
              "z - x MiB", (z.data_ptr() - x.data_ptr()) / 2**20, flush=True)
        jobs = {}
        for pname, fn in peers.items():
            def job(fn=fn, x=x, z=z):
                with torch.no_grad():
                    return br.time_call(lambda: fn(x, z), 66.0)
            jobs[pname] = job
        times, errors = br.interleaved_rounds(jobs, rounds)
        for pname, ts in times.items():
            dev = sorted(t[1] for t in ts)
            ms = sorted(t[0] for t in ts)
            out.setdefault(name, {})[pname] = {"device_us": dev, "do_bench_ms": ms}
            print(f"  {pname:34s} device {dev[len(dev)//2]:8.1f} us  do_bench "
                  f"{1000 * ms[len(ms)//2]:8.1f} us  rounds {[round(d, 1) for d in dev]}",
                  flush=True)
        if errors:
            print("  errors", errors)
        del jobs, keep
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gated_layout.json"), "w") as f:
        json.dump({"command": "python3 bench/micro/gated_layout.py", "commit":
                   os.environ.get("NORMSPEC_GIT_COMMIT"), "results": out}, f, indent=1)


main()
