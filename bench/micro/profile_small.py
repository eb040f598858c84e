"""Which kernels each peer launches per small-batch call, with their device durations and the
span from the first kernel's start to the last one's end (torch.profiler / CUPTI).
1 x 2048 and 64 x 2048 norm, 64 x 256 q/k: forward (no grad) and backward (dx, dweight),
each call after the bench's flush and sleep, as bench/run.py times it.

Usage (GPU, from the repository root): ``python3 bench/micro/profile_small.py``; it prints
per case and peer the kernels with their median CUPTI durations (µs)."""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import run as br  # bench/run.py: the peers, time_call, interleaved_rounds

WANT = ("torch.compile", "liger", "normspec torch_ext")
flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
for rows, hidden in ((1, 2048), (64, 2048), (64, 256)):
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.1 * torch.randn(hidden, device="cuda", generator=g)).to(torch.bfloat16)
    for name, fn in br.peers_norm(w).items():
        if not any(k in name for k in WANT):
            continue
        for direction in ("forward", "backward"):
            if direction == "forward":
                def call(fn=fn, x=x):
                    with torch.no_grad():
                        fn(x)
            else:
                leaf = x.detach().clone().requires_grad_()
                out = fn(leaf)
                gy = torch.randn_like(out)
                wrt = [leaf] + [p for p in br._weights(fn) if p.requires_grad]

                def call(out=out, gy=gy, wrt=wrt):
                    torch.autograd.grad([out], wrt, [gy], retain_graph=True, allow_unused=True)
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    flush.zero_()
                    torch.cuda._sleep(2_000_000)
                    call()
                torch.cuda.synchronize()
            evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
            # all but the sleep and the flush (a fill of unsigned char)
            kern = [e for e in evs if "sleep" not in e.name and "unsigned char" not in e.name]
            # per call: from the sleep kernel's end to the first kernel's start (the GPU's
            # launch gap; the host enqueued everything during the sleep) and to the last end
            evs = sorted(evs, key=lambda e: e.time_range.start)
            gaps, spans, cur = [], [], None
            for e in [*evs, None]:
                if e is None or "sleep" in e.name:
                    if cur and len(cur) > 1:
                        body = [k for k in cur[1:] if "unsigned char" not in k.name]
                        if body:
                            gaps.append(body[0].time_range.start - cur[0].time_range.end)
                            spans.append(body[-1].time_range.end - cur[0].time_range.end)
                    cur = [e]
                elif cur is not None:
                    cur.append(e)
            gaps.sort()
            spans.sort()
            if gaps:
                print(f"    launch gap after the sleep {gaps[len(gaps)//2]:.2f} us, sleep end to "
                      f"last kernel end {spans[len(spans)//2]:.2f} us")
            per = {}
            for e in kern:
                per.setdefault(e.name[:70], []).append(e.device_time)
            print(f"{rows}x{hidden} {direction:8} {name}")
            for k, v in per.items():
                v = sorted(v)
                print(f"    {len(v):3d} x {v[len(v)//2]:7.2f} us  {k}")
