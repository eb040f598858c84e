"""Does a small backward's time after the bench's L2 flush include fetching its code?

``triton.testing.do_bench`` and ``bench/device_timing.py`` flush L2 before every call, which
evicts the kernel's instructions as well as its data. Our one-row rms backward kernel is
392 SASS instructions, torch.compile's 176, so after the flush ours may wait longer on
instruction fetch (notes/perf.md §28). This script times the 1 x 2048 and 64 x 2048
backward (dx and dweight) of our extension and of torch.compile, GPU time alone (a sleep
kernel hides the host), in these modes:

* ``cold``: flush, sleep, call (the bench's timing);
* ``code warm``: flush, the same call on a second set of rows (its code is then in L2 and
  the instruction caches, the timed call's rows are not; the weight, 4 KiB, is shared),
  sleep, call;
* ``warm``: no flush, sleep, call (code and data in L2);
* ``pages warm``: flush, a one-element read of each input (x, dy, the weight), sleep, call
  (their address translations are warm, their lines but one each are not);
* ``data warm``: flush, a sum over each input, sleep, call (the inputs are in L2, the
  kernel's code is not);
* ``warm after other``: no flush, the same call on the second rows, sleep, call (``warm``
  with the prelude ``code warm`` has, to tell the prelude's own effect);
* ``read flush``: the flush buffer read (summed) instead of written, sleep, call. The
  bench's flush writes, which leaves L2 full of dirty lines, so every line a call then
  touches first costs a write-back; after a read L2 holds clean lines. If the gap is
  gone here, the write-backs are where it lies;
* ``saved warm``: flush, a sum over the inputs *and* every tensor the autograd graph saved
  (the forward's rstd among them, which ``data warm`` leaves cold), sleep, call: all the
  data the call reads is in L2, its code is not;
* ``saved only``: flush, a sum over the saved tensors that are not inputs (the rstd),
  sleep, call;
* ``tiny kernel``: flush, one extra kernel that touches no memory (a sleep of one cycle),
  sleep, call: the effect of one more kernel between the flush and the sleep kernel that
  always precedes the call;
* ``alloc only``: flush, a one-element tensor allocated and freed, sleep, call. Nothing
  reaches the GPU (the block goes back to the caching allocator's pool): the control for
  the allocation that ``saved only``'s sum makes besides its kernel.

If the gap between ours and torch.compile's is in ``cold`` and gone in ``code warm``, the
code's size is the cause; if it is gone in ``data warm``, the data's fetch is. Usage (GPU,
repository root):
``python3 bench/micro/code_warmth_small.py [--out DIR] [--calls 200]``; it prints a table
(median µs) and writes ``code_warmth_small.json`` under ``--out``; ``--modes`` picks a
subset of the modes (comma-separated). The JSON names, per case and backend, the tensors
the graph saved beyond the inputs (``saved``), which the ``saved`` modes warm; where there
are none those modes time what ``cold`` does, and the script says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import device_timing as dt
import run as br  # bench/run.py: the peers and their weights

WANT = ("torch.compile (transformers)", "normspec torch_ext")
MODES = ("cold", "code warm", "warm", "pages warm", "data warm", "warm after other",
         "read flush", "saved warm", "saved only", "tiny kernel", "alloc only")
# flushed by a write, as the bench does
FLUSHED = ("cold", "code warm", "pages warm", "data warm", "saved warm", "saved only",
           "tiny kernel", "alloc only")


def saved_tensors(out: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor saved for backward in ``out``'s autograd graph, each once: the
    ``saved_tensors`` of Python-defined nodes (custom ops' and torch.compile's autograd
    functions) and the ``_saved_*`` tensors of built-in nodes."""
    found: dict[int, torch.Tensor] = {}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        values = list(getattr(node, "saved_tensors", None) or ())
        values += [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        for t in values:
            if isinstance(t, torch.Tensor) and t.numel():
                found.setdefault(t.data_ptr(), t.detach())
        todo.extend(f for f, _ in node.next_functions)
    return list(found.values())


def backward_call(fn: Callable, x: torch.Tensor) -> tuple[
        Callable[[], object], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A closure running ``fn``'s backward (dx and dweight) on a fresh graph over ``x``,
    the inputs it reads (x, dy, the weights) and the other tensors its graph saved."""
    leaf = x.detach().clone().requires_grad_()
    out = fn(leaf)
    gy = torch.randn_like(out)
    weights = [p for p in br._weights(fn) if p.requires_grad]
    wrt = [leaf, *weights]

    def call() -> object:
        return torch.autograd.grad([out], wrt, [gy], retain_graph=True, allow_unused=True)

    inputs = tuple(t.detach() for t in [leaf, gy, *weights])
    have = {t.data_ptr() for t in inputs}
    extra = tuple(t for t in saved_tensors(out) if t.data_ptr() not in have)
    return call, inputs, extra


def device_us(call: Callable, mode: str, calls: int, flush: torch.Tensor,
              before: Callable, inputs: tuple[torch.Tensor, ...],
              extra: tuple[torch.Tensor, ...]) -> float:
    """Median GPU microseconds of ``call`` after the prelude ``mode`` names."""
    cycles = int(dt.HIDE_HOST_MS * dt.sleep_cycles_per_ms())
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]
    for start, end in events:
        if mode in FLUSHED:
            flush.zero_()
        elif mode == "read flush":
            flush.sum()
        if mode in ("code warm", "warm after other"):
            before()
        elif mode == "pages warm":
            for t in inputs:
                t.view(-1)[:1].sum()
        elif mode in ("data warm", "saved warm", "saved only"):
            for t in {"data warm": inputs, "saved warm": inputs + extra,
                      "saved only": extra}[mode]:
                t.sum()
        elif mode == "tiny kernel":
            torch.cuda._sleep(1)
        elif mode == "alloc only":
            torch.empty(1, device="cuda")  # dropped at once: back to the pool
        torch.cuda._sleep(cycles)
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the JSON")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per mode")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over every case, backend and mode (interleaved)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of: " + ", ".join(MODES))
    args = parser.parse_args()
    modes = list(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: unknown {unknown or 'none given'}; expected from {MODES}")
    # torch.compile donates buffers to its backward, which then refuses the repeated
    # autograd.grad(..., retain_graph=True) calls timed here (bench/run.py does the same)
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    if args.calls < 5 or args.rounds < 1:
        parser.error(f"--calls >= 5 and --rounds >= 1, got {args.calls} and {args.rounds}")
    br.BACKEND_FILTER = WANT  # builds no other peer (the CuPy backend's NVRTC compiles)
    flush = torch.empty(dt.FLUSH_BYTES // 4, dtype=torch.int, device="cuda")
    jobs, saved = {}, []
    for rows in (1, 64):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
        x2 = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
        w = (0.1 * torch.randn(2048, device="cuda", generator=g)).to(torch.bfloat16)
        for name, fn in br.peers_norm(w).items():
            if name not in WANT:
                continue
            (call, inputs, extra), (other, _, _) = backward_call(fn, x), backward_call(fn, x2)
            shapes = [[list(t.shape), str(t.dtype)] for t in extra]
            saved.append({"case": f"{rows}x2048", "backend": name, "saved": shapes})
            print(f"{rows}x2048 {name}: saved beyond the inputs {shapes}", file=sys.stderr)
            if not extra and {"saved warm", "saved only"} & set(modes):
                print(f"warning: {name} saved nothing beyond its inputs at {rows}x2048: its "
                      "'saved only' times what 'cold' does, its 'saved warm' what "
                      "'data warm' does", file=sys.stderr)
            for _ in range(5):
                call()
                other()
            for mode in modes:
                jobs[(f"{rows}x2048", name, mode)] = (call, other, inputs, extra)
    times: dict = {key: [] for key in jobs}
    for r in range(args.rounds):
        for key, (call, other, inputs, extra) in jobs.items():
            times[key].append(device_us(call, key[2], args.calls, flush, other, inputs, extra))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    rows_out = [{"case": c, "backend": b, "mode": m, "device_us": statistics.median(t),
                 "rounds_us": t} for (c, b, m), t in times.items()]
    print(f"{'case':10} {'backend':30} " + " ".join(f"{m:>16}" for m in modes))
    for case in dict.fromkeys(k[0] for k in jobs):
        for name in WANT:
            vals = [statistics.median(times[(case, name, m)]) for m in modes
                    if (case, name, m) in times]
            if vals:
                print(f"{case:10} {name:30} " + " ".join(f"{v:16.2f}" for v in vals))
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / "code_warmth_small.json"
    from normspec.report import git_state

    dest.write_text(json.dumps({"device": torch.cuda.get_device_name(), "calls": args.calls,
                                "rounds": args.rounds, "git": git_state(),
                                "command": "python3 " + " ".join(sys.argv),
                                "switches": {k: v for k, v in os.environ.items()
                                             if k.startswith("NORMSPEC_")
                                             and not k.startswith("NORMSPEC_GIT")},
                                "saved": saved, "rows": rows_out}, indent=1))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
