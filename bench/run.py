"""Benchmark normspec's kernels against their peers on one CUDA GPU.

Times forward and backward (dx and dweight together) of

* the decoder norm, rows ∈ {1, 64, 4096, 32768, 65536} × 2048 (zero-centred);
* the q/k norm, rows × 256;
* the fused residual add + norm, 32768 × 2048;
* the gated norm of the GDN layers, 2^21 × 128;

for: torch eager and ``torch.compile`` of the transformers formula (the real
``Qwen3NextRMSNorm`` / ``Qwen3NextRMSNormGated`` modules), Liger, FLA, and
normspec's ``torch_ext`` and ``cupy`` backends, each where it is installed.
Prints µs, TB/s and the fraction of the measured device-to-device copy
bandwidth, and writes JSON to ``bench/results/<gpu>.json``.

Bytes are the fewest a kernel must move: every row input read once, every
row output written once (the weight and dweight are negligible at these
sizes and not counted). Times are medians of CUDA-event timings
(``triton.testing.do_bench``, return_mode="median").

Usage: ``python bench/run.py [--quick] [--out bench/results]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

EPS = 1e-6
BF16 = torch.bfloat16


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
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


def _ours():
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
    try:
        from normspec.backends import cupy_backend

        if cupy_backend.available() is None:
            found.append(("normspec cupy", cupy_backend))
    except Exception as exc:
        print(f"cupy backend unavailable: {exc}", file=sys.stderr)
    return found


# --------------------------------------------------------------------------- timing


def _first(out):
    return out[0] if isinstance(out, tuple | list) else out


OP_NAMES = {"norm": "rms_norm", "fused": "fused_add_rms_norm", "gated": "rms_norm_gated"}


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
            **({"error": row["error"]} if "error" in row else {}),
        })
    return out


def time_case(kind: str, rows: int, hidden: int, bw: float, quick: bool) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_in = {"norm": 1, "fused": 2, "gated": 2}[kind]
    n_out = {"norm": 1, "fused": 2, "gated": 1}[kind]
    ins = [torch.randn(rows, hidden, device="cuda", generator=gen).to(BF16) for _ in range(n_in)]
    if kind == "gated":
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(BF16)
        peers = peers_gated(weight)
    else:
        weight = (0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(BF16)
        peers = peers_norm(weight) if kind == "norm" else peers_fused(weight)
    elem = rows * hidden * 2
    fwd_bytes = (n_in + n_out) * elem
    # backward reads the incoming gradients and the saved inputs, writes the input gradients
    bwd_bytes = (n_out + n_in + n_in) * elem
    results = []
    for name, fn in peers.items():
        if BACKEND_FILTER and not any(f in name for f in BACKEND_FILTER):
            continue
        row = {"kind": kind, "shape": [rows, hidden], "backend": name}
        try:
            with torch.no_grad():
                ms = bench_ms(lambda fn=fn: fn(*ins))
            row["forward_us"] = ms * 1e3
            row["forward_tbps"] = fwd_bytes / (ms * 1e-3) / 1e12
            row["forward_copy_fraction"] = row["forward_tbps"] / bw
            if not quick or rows >= 4096:
                leaves = [t.detach().clone().requires_grad_() for t in ins]
                out = fn(*leaves)
                outs = list(out) if isinstance(out, tuple | list) else [out]
                grads = [torch.randn_like(o) for o in outs]
                params = [p for p in _weights(fn) if p.requires_grad]
                wrt = leaves + params
                ms_b = bench_ms(lambda outs=outs, wrt=wrt, grads=grads: torch.autograd.grad(
                    outs, wrt, grads, retain_graph=True, allow_unused=True))
                row["backward_us"] = ms_b * 1e3
                row["backward_tbps"] = bwd_bytes / (ms_b * 1e-3) / 1e12
                row["backward_copy_fraction"] = row["backward_tbps"] / bw
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        results.append(row)
    return results


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
    # torch.compile donates buffers to its backward, which then refuses the
    # repeated autograd.grad(..., retain_graph=True) calls of the timing loop
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="skip backward on small shapes")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--backend", action="append", default=[], metavar="SUBSTRING",
                   help="time only peers whose name contains this (repeatable)")
    p.add_argument("--case", action="append", default=[], metavar="KIND:ROWS:H",
                   help="time only these cases, e.g. norm:32768:2048 (kind: norm, fused, gated)")
    args = p.parse_args(argv)
    try:
        cases = [parse_case(c) for c in args.case] or CASES
    except ValueError as exc:
        p.error(str(exc))
    global BACKEND_FILTER
    BACKEND_FILTER = tuple(args.backend)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    env = {"device_name": props.name, "capability": f"{props.major}.{props.minor}",
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "copy_tbps": bw, "command": "python bench/run.py " + " ".join(argv or sys.argv[1:])}
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
    print(f"{'case':<22}{'backend':<34}{'fwd us':>9}{'TB/s':>7}{'%copy':>7}"
          f"{'bwd us':>10}{'TB/s':>7}{'%copy':>7}")
    for row in rows:
        case = f"{row['kind']} {row['shape'][0]}x{row['shape'][1]}"
        if "error" in row:
            print(f"{case:<22}{row['backend']:<34} error: {row['error'][:60]}")
            continue
        fwd = (f"{row['forward_us']:>9.1f}{row['forward_tbps']:>7.2f}"
               f"{100 * row['forward_copy_fraction']:>6.0f}%")
        bwd = (f"{row['backward_us']:>10.1f}{row['backward_tbps']:>7.2f}"
               f"{100 * row['backward_copy_fraction']:>6.0f}%") if "backward_us" in row else ""
        print(f"{case:<22}{row['backend']:<34}{fwd}{bwd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
