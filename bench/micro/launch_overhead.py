"""Where a small call's event-timed microseconds go: into its kernels, or around them?

``bench/device_timing.py`` times a call between two CUDA events, after an L2 flush and a
sleep kernel that hides the host. With a 1 MiB flush (L2 stays warm) our small rms
forwards trailed the fastest peer by 0.13-0.35 µs in three processes (notes/perf.md §32).
Nsight Compute, with its caches left alone, gave our 2048-wide forward kernels durations
level with or shorter than torch.compile's (1 x 2048: 2.18 against 2.21 µs); Liger's, the
fastest peer at 2048, and the 256-wide cases were not profiled. Whether the gap is in the
kernels or around them (their launch, or what follows the last store) is open.

This script runs the bench's protocol under ``torch.profiler`` (CUPTI's GPU timestamps of
every kernel and memset) and splits each call's event time into:

* ``lead``: from the end of the sleep kernel to the start of the call's first kernel. It
  holds the start event's record as well as the launch, so it begins before the timed span
  does;
* ``span``: from the call's first kernel's start to its last kernel's end;
* ``kernels``: the sum of the call's kernels' durations (``span`` less the gaps between them);
* ``rest``: the event time less ``lead`` and ``span``, that is (end event less the last
  kernel's end) less (start event less the sleep's end): what follows the last kernel,
  less the part of ``lead`` before the start event. Compare it between backends, not with
  zero.

Each field is the median over the calls of a round, then over the rounds, so the medians
need not add up to the event time's. It also times each call without the profiler
(``event_plain``), so that what the profiler adds to the event time is seen. Each case is
built and timed before the next one (torch.compile's caches are reset per case, as in
``bench/run.py``), its backends and flush sizes interleaved in each round. Usage (GPU,
repository root)::

    python3 bench/micro/launch_overhead.py [--case norm:1:2048 ...] [--flush-mib 256
        --flush-mib 1] [--backend torch_ext --backend compile --backend liger]
        [--direction forward] [--dtype bfloat16] [--calls 100] [--rounds 2] [--out DIR]

Prints a table of medians (µs) and writes ``launch_overhead.json`` under ``--out`` (again
after each case, so that a run cut short keeps the cases it finished): per
case, direction, backend and flush size, the medians over the rounds, every round's values
and the names of the kernels the calls ran (over all rounds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/micro/
import device_timing as dt
import run as br  # bench/run.py: the peers and parse_case
from code_warmth_small import backward_call

#: Name of the sleep kernel of ``torch.cuda._sleep`` (aten/src/ATen/cuda/Sleep.cu).
SLEEP_KERNEL = "spin_kernel"
#: What the flush (``Tensor.zero_``) runs on the GPU: a fill kernel or a memset.
FLUSH_PATTERN = re.compile(r"fill|memset", re.IGNORECASE)
DEFAULT_CASES = ("norm:1:2048", "norm:64:256", "norm:64:2048", "norm:4096:2048")
DEFAULT_BACKENDS = ("torch_ext", "compile", "liger")
FIELDS = ("event_plain", "event", "lead", "span", "kernels", "rest")
#: ``--dtype``'s choices
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class Kernel(NamedTuple):
    """One GPU activity of the profile: its name and its start and end (ns, GPU clock)."""

    name: str
    start_ns: int
    end_ns: int


def split_calls(activities: Sequence[Kernel]) -> list[tuple[Kernel, list[Kernel]]]:
    """The timed calls of a profiled loop ``(flush, sleep, call) * n, flush, sleep``: per
    call the sleep kernel before it and the activities between that sleep and the next
    flush, in start order.

    Raises ``ValueError`` when the activity before a sleep kernel (but the first) is not a
    flush, or when fewer than two sleep kernels are in the profile: then the loop was not
    the one this script runs and the split would be wrong."""
    acts = sorted(activities, key=lambda k: k.start_ns)
    sleeps = [i for i, k in enumerate(acts) if SLEEP_KERNEL in k.name]
    if len(sleeps) < 2:
        raise ValueError(f"activities: expected at least two {SLEEP_KERNEL!r} kernels "
                         f"(one per call and one after the last), got {len(sleeps)}")
    calls = []
    for a, b in itertools.pairwise(sleeps):
        flush = acts[b - 1] if b - 1 > a else None
        if flush is None or not FLUSH_PATTERN.search(flush.name):
            seen = "nothing" if flush is None else repr(flush.name)
            raise ValueError(f"activities: expected a flush (fill or memset) right before "
                             f"the sleep kernel at {acts[b].start_ns} ns, got {seen}")
        calls.append((acts[a], acts[a + 1:b - 1]))
    return calls


def call_parts(sleep: Kernel, kernels: Sequence[Kernel], event_us: float) -> dict:
    """``lead``, ``span``, ``kernels`` and ``rest`` of one call (µs; module docstring) and
    its kernels' names. A call with no kernel has a span of 0 and no lead."""
    if not kernels:
        return {"lead": None, "span": 0.0, "kernels": 0.0, "rest": None, "names": []}
    first = min(k.start_ns for k in kernels)
    last = max(k.end_ns for k in kernels)
    lead = (first - sleep.end_ns) / 1e3
    span = (last - first) / 1e3
    return {"lead": lead, "span": span,
            "kernels": sum(k.end_ns - k.start_ns for k in kernels) / 1e3,
            "rest": event_us - lead - span, "names": [k.name for k in kernels]}


def median_parts(parts: Sequence[dict]) -> dict:
    """Per field of :func:`call_parts` (and ``event``), the median over the calls that
    have it (None where none has)."""
    out = {}
    for field in ("event", "lead", "span", "kernels", "rest"):
        vals = [p[field] for p in parts if p.get(field) is not None]
        out[field] = statistics.median(vals) if vals else None
    return out


def _gpu_activities(prof) -> list[Kernel]:
    """The GPU activities (kernels, memsets, copies) of a finished
    ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    acts = []
    for e in prof.profiler.kineto_results.events():
        # (user annotations are GPU-side too, but not work the GPU did; torch 2.11's
        # _KinetoEvent has no activity_type, only is_user_annotation)
        if e.device_type() != DeviceType.CUDA or e.is_user_annotation():
            continue
        acts.append(Kernel(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
    return acts


def time_call(call: Callable[[], object], flush, cycles: int, calls: int,
              profiled: bool) -> tuple[list[float], list[Kernel]]:
    """Event µs of ``calls`` calls of ``call``, each after a flush (``flush.zero_()``) and a
    sleep of ``cycles``; with ``profiled`` under ``torch.profiler``, whose GPU activities
    come back too (a last flush and sleep close the last call)."""
    from torch.profiler import ProfilerActivity, profile

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]

    def loop() -> None:
        for start, end in events:
            flush.zero_()
            torch.cuda._sleep(cycles)
            start.record()
            call()
            end.record()
        flush.zero_()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    if not profiled:
        loop()
        return [s.elapsed_time(e) * 1e3 for s, e in events], []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop()
    return [s.elapsed_time(e) * 1e3 for s, e in events], _gpu_activities(prof)


def _calls(case: tuple[str, int, int], backends: Sequence[str], directions: Sequence[str],
           dtype: torch.dtype = torch.bfloat16) -> dict[tuple[str, str], Callable[[], object]]:
    """``(backend, direction) -> call`` of the rms norm case for the backends whose names
    contain one of ``backends``, as ``bench/run.py`` times them (forward without grad), on
    rows and a weight of ``dtype``."""
    kind, rows, hidden = case
    if kind != "norm":
        raise ValueError(f"--case: only the rms norm (norm:ROWS:H) is timed here, got {kind!r}")
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
    w = (0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    out = {}
    for name, fn in br.peers_norm(w).items():
        if not any(b in name for b in backends):
            continue
        if "forward" in directions:
            def forward(fn=fn) -> object:
                with torch.no_grad():
                    return fn(x)
            out[(name, "forward")] = forward
        if "backward" in directions:
            out[(name, "backward")] = backward_call(fn, x)[0]
    return out


def _flush_buffer(mib: int):
    """The tensor whose ``zero_()`` is the flush of ``mib`` MiB."""
    return torch.empty(mib * 2**20 // 4, dtype=torch.int, device="cuda")


def time_round(call: Callable[[], object], flush, cycles: int, calls: int, names: set,
               label: str) -> dict:
    """One round of ``call``: ``calls`` calls unprofiled, then as many profiled; the
    medians of :func:`call_parts`' fields over the profiled calls, with ``event_plain`` the
    unprofiled calls' median. Adds the names of the kernels the calls ran to ``names``."""
    plain, _ = time_call(call, flush, cycles, calls, profiled=False)
    event, acts = time_call(call, flush, cycles, calls, profiled=True)
    split = split_calls(acts)
    if len(split) != len(event):
        raise RuntimeError(f"{label}: {len(event)} calls timed, {len(split)} found in the "
                           "profile")
    parts = [call_parts(s, ks, e) | {"event": e}
             for (s, ks), e in zip(split, event, strict=True)]
    names.update(n for q in parts for n in q["names"])
    return median_parts(parts) | {"event_plain": statistics.median(plain)}


def summarize(case: str, rounds: dict, names: dict) -> list[dict]:
    """The JSON rows of one case: per ``(backend, direction, flush MiB)`` of ``rounds``
    (each a list of :func:`time_round` results) the median over the rounds of each field
    (None where no round has it), every round, and the kernels' names, sorted."""
    rows = []
    for (name, direction, mib), per_round in rounds.items():
        med = {}
        for f in FIELDS:
            vals = [q[f] for q in per_round if q.get(f) is not None]
            med[f"{f}_us"] = statistics.median(vals) if vals else None
        rows.append({"case": case, "direction": direction, "backend": name, "flush_mib": mib,
                     **med, "rounds": per_round,
                     "kernels_run": sorted(names[(name, direction, mib)])})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], metavar="norm:ROWS:H",
                   help=f"repeatable (default: {', '.join(DEFAULT_CASES)})")
    p.add_argument("--flush-mib", action="append", type=int, default=[],
                   help="the flush before each call, MiB; repeatable (default: 256 and 1)")
    p.add_argument("--backend", action="append", default=[], metavar="SUBSTRING",
                   help=f"repeatable (default: {', '.join(DEFAULT_BACKENDS)})")
    p.add_argument("--direction", action="append", default=[],
                   choices=("forward", "backward"), help="repeatable (default: both)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="the rows' and the weight's dtype (default: bfloat16, the bench's)")
    p.add_argument("--calls", type=int, default=100, help="timed calls per round (>= 5)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (>= 1)")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the JSON")
    args = p.parse_args(argv)
    try:
        cases = [br.parse_case(c) for c in args.case or DEFAULT_CASES]
    except ValueError as exc:
        p.error(str(exc))
    flushes = list(dict.fromkeys(args.flush_mib or [256, 1]))
    if min(flushes) < 1:
        p.error(f"--flush-mib: expected 1 MiB or more, got {min(flushes)}")
    if args.calls < 5 or args.rounds < 1:
        p.error(f"--calls >= 5 and --rounds >= 1, got {args.calls} and {args.rounds}")
    import torch._functorch.config as functorch_config

    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    # torch.compile donates buffers to its backward, which then refuses repeated calls
    functorch_config.donated_buffer = False
    cycles = int(dt.HIDE_HOST_MS * dt.sleep_cycles_per_ms())
    directions = args.direction or ["forward", "backward"]
    br.BACKEND_FILTER = tuple(args.backend or DEFAULT_BACKENDS)  # no other peer is built
    flush_of = {mib: _flush_buffer(mib) for mib in flushes}
    from normspec.report import git_state

    dest = args.out / "launch_overhead.json"
    head = {"device": torch.cuda.get_device_name(), "calls": args.calls,
            "rounds": args.rounds, "dtype": args.dtype, "git": git_state(),
            "command": "python3 " + " ".join(sys.argv),
            "hide_host_ms": dt.HIDE_HOST_MS, "cases": [f"{r}x{h}" for _, r, h in cases]}
    rows = []
    for case in cases:
        calls = _calls(case, br.BACKEND_FILTER, directions, DTYPES[args.dtype])
        if not calls:
            p.error(f"no backend matched --backend {list(br.BACKEND_FILTER)}")
        for call in calls.values():
            for _ in range(5):
                call()
        jobs = {(name, direction, mib): call for (name, direction), call in calls.items()
                for mib in flushes}
        rounds: dict = {key: [] for key in jobs}
        names: dict = {key: set() for key in jobs}
        for r in range(args.rounds):
            for key, call in jobs.items():
                rounds[key].append(time_round(call, flush_of[key[2]], cycles, args.calls,
                                              names[key], f"{case}, {key}"))
            print(f"{case[1]}x{case[2]}: round {r + 1} of {args.rounds} done",
                  file=sys.stderr)
        rows += summarize(f"{case[1]}x{case[2]}", rounds, names)
        write_json(dest, head | {"rows": rows})  # after every case: a cut run keeps them
    print(f"{'case':10} {'dir':8} {'backend':30} {'flush':>5} "
          + " ".join(f"{f:>11}" for f in FIELDS))
    for r in rows:
        print(f"{r['case']:10} {r['direction']:8} {r['backend'][:30]:30} {r['flush_mib']:5} "
              + " ".join("        n/a" if r[f"{f}_us"] is None else f"{r[f'{f}_us']:11.2f}"
                         for f in FIELDS))
    print(f"wrote {dest}")
    return 0


def write_json(dest: Path, data: dict) -> None:
    """``data`` as JSON at ``dest``, its folder made first."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
