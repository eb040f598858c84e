"""Benchmark normspec's kernels against their peers on one CUDA GPU.

Times forward and backward (dx and dweight together) of

* the decoder norm, rows ∈ {1, 64, 4096, 32768, 65536} × 2048 (zero-centred);
* the q/k norm, rows × 256;
* the fused residual add + norm, 32768 × 2048;
* the gated norm of the GDN layers, 2^21 × 128;

for: torch eager and ``torch.compile`` of the transformers formula (the real
``Qwen3NextRMSNorm`` / ``Qwen3NextRMSNormGated`` modules), Liger, FLA,
FlashInfer (forward only: it has no backward), and normspec's ``torch_ext`` and
``cupy`` backends, each where it is installed.
Prints µs, TB/s and the fraction of the measured device-to-device copy
bandwidth (a 1 GiB copy), and writes JSON to ``bench/results/<gpu>.json``.
Every case also gets a reference row, ``device copy (same bytes)``: a copy
that moves the case's bytes, timed the same way. do_bench flushes L2 by
writing it full before every call, and a kernel then also pays for writing
those dirty lines back, which the 1 GiB copy spreads thin. That row shows how
close to a copy a kernel of this size can get.

Bytes are the fewest a kernel must move: every row input read once, every
row output written once (the weight and dweight are negligible at these
sizes and not counted). The fused backward counts four rows (dy and the new
residual's gradient read, the saved sum read, one gradient written): with the
"rounded" convention the new residual is the sum the norm read, and dx equals
dresidual bit for bit, so a kernel needs no more (earlier results counted six).
Every call is timed two ways, both after an L2 flush:

* ``us`` (the table's *call* column): CUDA-event timing with
  ``triton.testing.do_bench`` (return_mode="median"). Its start event runs as
  soon as the flush ends, so wherever the host needs longer than the flush to
  launch the call (Python, dispatch, the autograd engine: every backward here),
  the host's gap counts as GPU time.
* ``device_us`` (*dev*): the same call with a sleep kernel between the flush
  and the start event, long enough for the host to enqueue the whole call
  first: the GPU's time alone. ``host_us`` is how long enqueueing took. TB/s
  and the copy fraction are printed from this time.

Each timing is taken in ``--rounds`` interleaved rounds (every backend of a
case once per round, round after round), so that a slow spell of a shared
machine hits every backend alike; a row keeps the median over the rounds,
every round's call time and the spreads ((max - min) / median), and the
table flags spreads over 10 %.

Usage: ``python bench/run.py [--quick] [--rounds 3] [--out bench/results]``; ``--case``
and ``--backend`` narrow it, ``--flush-mib`` and ``--hide-host-ms`` change the device
timing's flush and sleep (to see how a kernel's time depends on them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import platform
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_timing import FLUSH_BYTES, HIDE_HOST_MS, device_us

#: Whether time_call also takes the device timing (off without CUDA and by --no-device-time).
DEVICE_TIMING = True
#: The device timing's L2 flush (MiB) and host-hiding sleep (ms); --flush-mib, --hide-host-ms.
FLUSH_MIB = FLUSH_BYTES // 2**20
HIDE_MS = HIDE_HOST_MS
#: No-op kernels between the device timing's flush and its sleep; --after-flush-kernels.
AFTER_FLUSH_KERNELS = 0
EPS = 1e-6
BF16 = torch.bfloat16


#: Target milliseconds of one timing (do_bench's ``rep``), split over the rounds.
REP_MS = 200
ROUNDS = 3
NOISY = 0.10


def bench_ms(fn: Callable[[], object], rep: float = REP_MS) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def time_call(fn: Callable[[], object], rep: float) -> tuple[float, float | None, float | None]:
    """(do_bench milliseconds, device microseconds, host microseconds); the last two are
    None where device timing is off."""
    ms = bench_ms(fn, rep)
    if not DEVICE_TIMING or not torch.cuda.is_available():
        return ms, None, None
    dev, host = device_us(fn, rep, hide_host_ms=HIDE_MS, flush_bytes=FLUSH_MIB * 2**20,
                          after_flush_kernels=AFTER_FLUSH_KERNELS)
    return ms, dev, host


def interleaved_rounds(jobs: dict, rounds: int) -> tuple[dict, dict]:
    """Run every job (a callable returning a timing) once per round, in the
    same order each round: a, b, c, a, b, c, ... Returns ``(times, errors)``:
    each job's list of times and, for a job that raised, its error (the job is
    not run again)."""
    times: dict = {key: [] for key in jobs}
    errors: dict = {}
    for _ in range(rounds):
        for key, job in jobs.items():
            if key in errors:
                continue
            try:
                times[key].append(job())
            except Exception as exc:
                errors[key] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)
    return times, errors


def summarize(times: list[float]) -> tuple[float, float]:
    """Median of the rounds and their spread, (max - min) / median."""
    ordered = sorted(times)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    return median, (ordered[-1] - ordered[0]) / median if median > 0 else 0.0


#: The reference row of every case: a device-to-device copy that moves the case's bytes.
SAME_BYTES = "device copy (same bytes)"


def _copy_job(nbytes: int, device: str, rep: float) -> Callable[[], float]:
    """A job timing ``dst.copy_(src)`` with ``nbytes / 2`` bytes each way: the same traffic
    as the case, under the same timing (L2 flushed before every call). At small and
    medium sizes it shows the floor that launch latency and the flush's write-backs set,
    which the large copy of :func:`copy_bandwidth` does not."""
    state = {}

    def job():
        if not state:
            state["src"] = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
            state["dst"] = torch.empty_like(state["src"])
        return time_call(lambda: state["dst"].copy_(state["src"]), rep)

    return job


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = min(bench_ms(lambda: dst.copy_(src)) for _ in range(ROUNDS))
    return 2 * src.numel() / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- peers


def _hf_norm(hidden: int, weight: torch.Tensor):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    m = Qwen3NextRMSNorm(hidden, eps=EPS).to(device="cuda", dtype=weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


def _hf_gated(hidden: int, weight: torch.Tensor):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    m = Qwen3NextRMSNormGated(hidden, eps=EPS).to(device="cuda", dtype=weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


def peers_norm(weight: torch.Tensor) -> dict[str, Callable]:
    """name -> f(x) for the zero-centred norm."""
    hidden = weight.shape[0]
    out: dict[str, Callable] = {}
    m = _hf_norm(hidden, weight)
    out["torch eager (transformers)"] = m
    out["torch.compile (transformers)"] = torch.compile(m)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        out["liger"] = lambda x: LigerRMSNormFunction.apply(x, m.weight, EPS, 1.0, "gemma",
                                                            False)
    except Exception as exc:
        print(f"liger unavailable: {exc}", file=sys.stderr)
    try:
        from fla.modules.layernorm import rms_norm as fla_rms_norm

        w1 = (1.0 + m.weight.detach().float()).to(weight.dtype).requires_grad_()
        out["fla"] = lambda x: fla_rms_norm(x, w1, None, eps=EPS)
    except Exception as exc:
        print(f"fla unavailable: {exc}", file=sys.stderr)
    try:
        from flashinfer.norm import gemma_rmsnorm

        out[FLASHINFER] = lambda x: gemma_rmsnorm(x, m.weight, EPS)
    except Exception as exc:
        print(f"flashinfer unavailable: {exc}", file=sys.stderr)
    for name, mod in _ours():
        out[name] = lambda x, mod=mod: mod.rms_norm(x, m.weight, eps=EPS, offset=1.0)
    return out


def peers_fused(weight: torch.Tensor) -> dict[str, Callable]:
    """name -> f(x, r) -> (y, new_residual), rounded residual convention."""
    hidden = weight.shape[0]
    m = _hf_norm(hidden, weight)

    def eager(x, r):
        s = r + x
        return m(s), s

    out: dict[str, Callable] = {"torch eager (transformers)": eager,
                                "torch.compile (transformers)": torch.compile(eager)}
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        out["liger"] = lambda x, r: LigerFusedAddRMSNormFunction.apply(x, r, m.weight, EPS, 1.0,
                                                                       "gemma", False)
    except Exception as exc:
        print(f"liger fused add unavailable: {exc}", file=sys.stderr)
    try:
        from flashinfer.norm import gemma_fused_add_rmsnorm

        def flashinfer_fused(x, r):  # in place: r becomes the sum, x the output
            gemma_fused_add_rmsnorm(x, r, m.weight, EPS)
            return x, r

        out[FLASHINFER] = flashinfer_fused
    except Exception as exc:
        print(f"flashinfer fused add unavailable: {exc}", file=sys.stderr)
    for name, mod in _ours():
        out[name] = lambda x, r, mod=mod: mod.fused_add_rms_norm(
            x, r, m.weight, eps=EPS, offset=1.0, residual_sum="rounded")
    return out


def peers_gated(weight: torch.Tensor) -> dict[str, Callable]:
    """name -> f(x, z) for the gated norm."""
    hidden = weight.shape[0]
    m = _hf_gated(hidden, weight)
    out: dict[str, Callable] = {"torch eager (transformers)": m,
                                "torch.compile (transformers)": torch.compile(m)}
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated

        out["fla"] = lambda x, z: rms_norm_gated(x, z, m.weight, None, activation="swish",
                                                 eps=EPS)
    except Exception as exc:
        print(f"fla gated unavailable: {exc}", file=sys.stderr)
    for name, mod in _ours():
        out[name + " (hf)"] = lambda x, z, mod=mod: mod.rms_norm_gated(
            x, z, m.weight, eps=EPS, convention="hf")
        out[name + " (vllm)"] = lambda x, z, mod=mod: mod.rms_norm_gated(
            x, z, m.weight, eps=EPS, convention="vllm")
    return out


#: FlashInfer's peer name: forward only (it has no backward); its fused add works in place
#: and normalises the fp32 sum (the others here the rounded one), the same bytes moved.
FLASHINFER = "flashinfer"
#: Peers timed forward only.
FORWARD_ONLY = frozenset({FLASHINFER})


def _wanted(name: str) -> bool:
    """Whether ``--backend`` keeps a peer of this name (every peer without the flag)."""
    return not BACKEND_FILTER or any(f in name for f in BACKEND_FILTER)


def _ours():
    """normspec's backends that run here and that ``--backend`` keeps. A backend filtered
    out is not even loaded: the CuPy backend's first use compiles all of its kernels with
    NVRTC, over a minute on a fresh machine."""
    found = []
    suffixes = ("", " (hf)", " (vllm)")
    if any(_wanted("normspec torch_ext" + s) for s in suffixes):
        found += _load_torch_ext()
    if any(_wanted("normspec cupy" + s) for s in suffixes):
        found += _load_cupy()
    return found


@functools.cache
def _load_torch_ext():
    found = []
    try:
        from normspec.backends import torch_ext

        reason = torch_ext.available()
        if reason is None:
            found.append(("normspec torch_ext", torch_ext))
        else:
            print(f"torch_ext unavailable: {reason}", file=sys.stderr)
    except Exception as exc:
        print(f"torch_ext unavailable: {exc}", file=sys.stderr)
    return found


@functools.cache
def _load_cupy():
    found = []
    try:
        from normspec.backends import cupy as normspec_cupy

        print("loading the CuPy backend (its first use on a machine compiles its kernels)",
              file=sys.stderr, flush=True)
        if normspec_cupy.available() is None:
            found.append(("normspec cupy", normspec_cupy))
    except Exception as exc:
        print(f"cupy backend unavailable: {exc}", file=sys.stderr)
    return found


# --------------------------------------------------------------------------- timing


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


OP_NAMES = {"norm": "rms_norm", "fused": "fused_add_rms_norm", "gated": "rms_norm_gated"}


#: The device timing's fields of a row (see device_us), kept where measured.
DEVICE_KEYS = ("device_us", "device_tbps", "device_copy_fraction", "device_spread", "host_us")


def split_directions(row: dict) -> list[dict]:
    """One result row per direction, in the schema docs_gen/bench.py renders."""
    out = []
    for direction in ("forward", "backward"):
        if f"{direction}_us" not in row and not ("error" in row and direction == "forward"):
            continue
        out.append({
            "name": OP_NAMES[row["kind"]], "shape": row["shape"], "backend": row["backend"],
            "direction": direction, "us": row.get(f"{direction}_us"),
            "tbps": row.get(f"{direction}_tbps"),
            "copy_fraction": row.get(f"{direction}_copy_fraction"),
            **({"us_rounds": row[f"{direction}_us_rounds"],
                "spread": row[f"{direction}_spread"]} if f"{direction}_spread" in row else {}),
            **{key: row[f"{direction}_{key}"] for key in DEVICE_KEYS
               if f"{direction}_{key}" in row},
            **({"error": row["error"]} if "error" in row else {}),
        })
    return out


def time_case(kind: str, rows: int, hidden: int, bw: float, quick: bool,
              device: str = "cuda") -> list[dict]:
    # Every case compiles the same transformers forward again (a new shape, with and
    # without grad). Dynamo keeps at most config.recompile_limit (8) versions of one code
    # object and then runs it eagerly: without a reset, the last norm cases timed
    # torch.compile's backward as eager (the q/k 524288 x 256 backward at 4052 us).
    torch._dynamo.reset()
    gen = torch.Generator(device=device).manual_seed(0)
    n_in = {"norm": 1, "fused": 2, "gated": 2}[kind]
    n_out = {"norm": 1, "fused": 2, "gated": 1}[kind]
    ins = [torch.randn(rows, hidden, device=device, generator=gen).to(BF16)
           for _ in range(n_in)]
    if kind == "gated":
        weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(BF16)
        peers = peers_gated(weight)
    else:
        weight = (0.1 * torch.randn(hidden, device=device, generator=gen)).to(BF16)
        peers = peers_norm(weight) if kind == "norm" else peers_fused(weight)
    elem = rows * hidden * 2
    fwd_bytes = (n_in + n_out) * elem
    # backward reads the incoming gradients and the saved rows, writes the input gradients;
    # the fused op (the "rounded" convention here) needs one of each: its new residual is
    # the sum the norm read, and dx and dresidual are the same bits by the spec
    n_saved = {"norm": 1, "fused": 1, "gated": 2}[kind]
    bwd_bytes = (n_out + 2 * n_saved) * elem
    rows_out, jobs = {}, {}
    rep = max(20.0, REP_MS / ROUNDS)
    for name, fn in peers.items():
        if not _wanted(name):
            continue
        rows_out[name] = {"kind": kind, "shape": [rows, hidden], "backend": name}

        def forward(fn=fn):
            with torch.no_grad():
                return time_call(lambda: fn(*ins), rep)

        jobs[(name, "forward")] = forward
        if name not in FORWARD_ONLY and (not quick or rows >= 4096):
            jobs[(name, "backward")] = _backward_job(fn, ins, rep)
    rows_out[SAME_BYTES] = {"kind": kind, "shape": [rows, hidden], "backend": SAME_BYTES}
    jobs[(SAME_BYTES, "forward")] = _copy_job(fwd_bytes, device, rep)
    if any(d == "backward" for _, d in jobs):
        jobs[(SAME_BYTES, "backward")] = _copy_job(bwd_bytes, device, rep)
    times, errors = interleaved_rounds(jobs, ROUNDS)
    nbytes = {"forward": fwd_bytes, "backward": bwd_bytes}
    for (name, direction), timings in times.items():
        row = rows_out[name]
        if (name, direction) in errors:
            row.setdefault("error", errors[(name, direction)])
            continue
        parts = [t if isinstance(t, tuple) else (t, None, None) for t in timings]
        ms, spread = summarize([p[0] for p in parts])
        if all(p[1] is not None for p in parts):
            dev_us, dev_spread = summarize([p[1] for p in parts])
            row[f"{direction}_device_us"] = dev_us
            row[f"{direction}_device_spread"] = dev_spread
            row[f"{direction}_device_tbps"] = nbytes[direction] / (dev_us * 1e-6) / 1e12
            row[f"{direction}_device_copy_fraction"] = row[f"{direction}_device_tbps"] / bw
            row[f"{direction}_host_us"] = summarize([p[2] for p in parts])[0]
        row[f"{direction}_us"] = ms * 1e3
        row[f"{direction}_us_rounds"] = [p[0] * 1e3 for p in parts]
        row[f"{direction}_spread"] = spread
        row[f"{direction}_tbps"] = nbytes[direction] / (ms * 1e-3) / 1e12
        row[f"{direction}_copy_fraction"] = row[f"{direction}_tbps"] / bw
    return list(rows_out.values())


def _backward_job(fn, ins, rep):
    """A job timing dx and dweight together (the graph is built at the first call)."""
    state = {}

    def job():
        if not state:
            leaves = [t.detach().clone().requires_grad_() for t in ins]
            out = fn(*leaves)
            outs = list(out) if isinstance(out, tuple | list) else [out]
            state["outs"] = outs
            state["grads"] = [torch.randn_like(o) for o in outs]
            state["wrt"] = leaves + [p for p in _weights(fn) if p.requires_grad]
        return time_call(lambda: torch.autograd.grad(
            state["outs"], state["wrt"], state["grads"], retain_graph=True,
            allow_unused=True), rep)

    return job


def _weights(fn) -> list[torch.Tensor]:
    """The weight parameter a peer closes over (for dweight in the backward)."""
    mod = getattr(fn, "_orig_mod", fn)
    if isinstance(mod, torch.nn.Module):
        return list(mod.parameters())
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        v = cell.cell_contents
        if isinstance(v, torch.nn.Module):
            found += list(v.parameters())
        elif isinstance(v, torch.Tensor) and v.requires_grad:
            found.append(v)
    return found


# The shapes the targets are about come first, so a run stopped early keeps them.
CASES = [
    ("norm", 32768, 2048), ("gated", 2**21, 128), ("fused", 32768, 2048),
    ("norm", 65536, 2048), ("norm", 4096, 2048), ("norm", 64, 2048), ("norm", 1, 2048),
    ("norm", 32768 * 16, 256), ("norm", 4096, 256), ("norm", 64, 256),
]


def parse_case(text: str) -> tuple[str, int, int]:
    """``"norm:32768:2048"`` -> ``("norm", 32768, 2048)``."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in OP_NAMES or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"--case: expected KIND:ROWS:H with KIND in {sorted(OP_NAMES)}, "
                         f"got {text!r}")
    return parts[0], int(parts[1]), int(parts[2])


#: Substrings of the peer names to time (empty: all); set by --backend.
BACKEND_FILTER: tuple[str, ...] = ()


def main(argv=None) -> int:
    global BACKEND_FILTER, ROUNDS, DEVICE_TIMING, FLUSH_MIB, HIDE_MS, AFTER_FLUSH_KERNELS
    # torch.compile donates buffers to its backward, which then refuses the
    # repeated autograd.grad(..., retain_graph=True) calls of the timing loop
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="skip backward on small shapes")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="interleaved timing rounds per case (median kept; default 3)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--backend", action="append", default=[], metavar="SUBSTRING",
                   help="time only peers whose name contains this (repeatable)")
    p.add_argument("--case", action="append", default=[], metavar="KIND:ROWS:H",
                   help="time only these cases, e.g. norm:32768:2048 (kind: norm, fused, gated)")
    p.add_argument("--no-device-time", action="store_true",
                   help="only do_bench's timing (skip the device timing that hides host gaps)")
    p.add_argument("--flush-mib", type=int, default=FLUSH_MIB,
                   help=f"the device timing's L2 flush before each call, MiB (default {FLUSH_MIB})")
    p.add_argument("--hide-host-ms", type=float, default=HIDE_MS,
                   help="the device timing's sleep kernel before each call, ms; 0 leaves it "
                        f"out (default {HIDE_MS})")
    p.add_argument("--after-flush-kernels", type=int, default=0, metavar="N",
                   help="no-op kernels between the device timing's flush and its sleep; they "
                        "move small launches' times (default 0)")
    args = p.parse_args(argv)
    try:
        cases = [parse_case(c) for c in args.case] or CASES
    except ValueError as exc:
        p.error(str(exc))
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.flush_mib < 1:
        p.error(f"--flush-mib must be at least 1, got {args.flush_mib}")
    if args.hide_host_ms < 0:
        p.error(f"--hide-host-ms must be 0 or more, got {args.hide_host_ms}")
    if args.after_flush_kernels < 0:
        p.error(f"--after-flush-kernels must be 0 or more, got {args.after_flush_kernels}")
    FLUSH_MIB, HIDE_MS = args.flush_mib, args.hide_host_ms
    AFTER_FLUSH_KERNELS = args.after_flush_kernels
    BACKEND_FILTER = tuple(args.backend)
    ROUNDS = args.rounds
    DEVICE_TIMING = not args.no_device_time
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    env = {"device_name": props.name, "capability": f"{props.major}.{props.minor}",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "copy_tbps": bw, "command": "python bench/run.py " + " ".join(argv or sys.argv[1:]),
           "device_timing": {"flush_mib": FLUSH_MIB, "hide_host_ms": HIDE_MS,
                             "after_flush_kernels": AFTER_FLUSH_KERNELS}}
    try:
        from normspec.report import git_state

        env["git"] = git_state()
    except Exception:
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / (props.name.replace(" ", "_") + ".json")
    rows = []
    for kind, r, h in cases:
        print(f"timing {kind} {r}x{h} ...", file=sys.stderr, flush=True)
        rows += time_case(kind, r, h, bw, args.quick)
        # written after every case, so a run stopped part-way keeps what it measured
        flat = [d for row in rows for d in split_directions(row)]
        path.write_text(json.dumps({"environment": env, "rows": flat}, indent=1) + "\n")
    print(f"\ncopy bandwidth {bw:.2f} TB/s (read + write); results in {path}\n")
    print("call us: do_bench's median (host launch gaps included); dev us: the GPU alone "
          "(host work hidden behind a sleep kernel); TB/s and %copy from dev us where "
          "measured, else from call us\n")
    print(f"{'case':<20}{'backend':<31}{'fwd call':>9}{'dev':>8}{'TB/s':>6}{'%copy':>7}"
          f"{'bwd call':>10}{'dev':>8}{'TB/s':>6}{'%copy':>7}")
    noisy = 0
    for row in rows:
        case = f"{row['kind']} {row['shape'][0]}x{row['shape'][1]}"
        if "forward_us" not in row:
            print(f"{case:<20}{row['backend'][:30]:<31} error: {row.get('error', '?')[:60]}")
            continue
        cells = []
        for d, width in (("forward", 9), ("backward", 10)):
            if f"{d}_us" not in row:
                continue
            spread = row.get(f"{d}_device_spread", row[f"{d}_spread"])
            flag = "*" if spread > NOISY else " "
            noisy += flag == "*"
            dev = row.get(f"{d}_device_us")
            tbps = row.get(f"{d}_device_tbps", row[f"{d}_tbps"])
            frac = row.get(f"{d}_device_copy_fraction", row[f"{d}_copy_fraction"])
            dev_cell = f"{dev:>8.1f}" if dev is not None else f"{'-':>8}"
            cells.append(f"{row[f'{d}_us']:>{width}.1f}{dev_cell}{tbps:>6.2f}"
                         f"{100 * frac:>6.0f}%{flag}")
        print(f"{case:<20}{row['backend'][:30]:<31}{''.join(cells)}")
    if noisy:
        print(f"\n* {noisy} timing(s) varied by more than {100 * NOISY:.0f}% across the "
              f"{ROUNDS} rounds (us_rounds in the JSON)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
