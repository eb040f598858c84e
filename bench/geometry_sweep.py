"""Sweep the geometry of the torch_ext CUDA kernels (team sizes, dweight groups, kernel family).

The launcher (``backends/csrc/normspec_launch_impl.cuh``) reads ``NORMSPEC_FWD_TEAM``,
``NORMSPEC_BWD_TEAM``, ``NORMSPEC_BWD_GLOG``, ``NORMSPEC_PIPE`` (``0``: the register /
streaming kernels instead of the pipelined ones), ``NORMSPEC_FWD_ROW`` (``0``: the
persistent forward instead of one row per team), ``NORMSPEC_GATE_TABLE`` (``0``: the
gated kernels evaluate the activation for every element) and ``NORMSPEC_FULL_ROW``
(``0``: the general-geometry kernels also where a constant-geometry form exists)
``NORMSPEC_SAVED_RSTD`` (``0``: the backward recomputes rstd instead of reading the
forward's), ``NORMSPEC_GATED_ROW_TABLE`` (``0``: large bf16 gated forwards on the
persistent kernel with a gate table per block, not one row per team with a table in
global memory: ``rowtable=0``)
and ``NORMSPEC_ROW_BLOCK`` (threads per block of the one-row forward for teams of at
most 32 lanes; by default 256, or 32 for launches of many waves: the
``rowblock=32/64/128/256`` candidates)
once per process, so every candidate runs in a fresh subprocess. Each child

* times forward and backward (dx and dweight together, through
  ``torch.autograd.grad`` on the operator) of the decoder norm 32768 x 2048,
  the q/k norm 524288 x 256, the fused residual add + norm 32768 x 2048 and the
  gated norm 2^21 x 128 (all bf16): the GPU's time alone, after an L2 flush
  (median; bench/device_timing.py);
* checks bitwise equality with the spec: the full outputs of one smaller call
  per case (same H, so the same geometry) against references the parent
  computed once on the CPU with ``normspec.spec``, and a bit-exact fingerprint
  of the big (timed) call's outputs, which the parent compares with the
  default geometry's (the dweight plan depends on the row count);
* prints one JSON line.

The parent builds the extension first (so no child compiles), prints a table
and writes ``bench/results/sweeps/geometry_sweep.json``. A failing candidate is
reported, not fatal. Runtime on an H200: about 2-3 minutes (plus the build
when the sources changed).

Usage: ``python bench/geometry_sweep.py [--fwd 64,128,256,512,1024] [--bwd 64,128,256]
[--glog 2,3,4,5] [--teams 4,8,16,64] [--only default,rstd=0]
[--out bench/results/sweeps/geometry_sweep.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_timing import device_us

EPS = 1e-6
BF16 = torch.bfloat16
ENV_VARS = ("NORMSPEC_FWD_TEAM", "NORMSPEC_BWD_TEAM", "NORMSPEC_BWD_GLOG", "NORMSPEC_PIPE",
            "NORMSPEC_FWD_ROW", "NORMSPEC_GATE_TABLE", "NORMSPEC_FULL_ROW",
            "NORMSPEC_SAVED_RSTD", "NORMSPEC_ROW_BLOCK", "NORMSPEC_GATED_ROW_TABLE")
MARK = "GEOMETRY_SWEEP_RESULT "

# name -> (op, timed rows, verified rows, H, params)
CASES = {
    "rms 32768x2048": ("rms_norm", 32768, 8192, 2048, {"offset": 1.0}),
    "qk 524288x256": ("rms_norm", 524288, 16384, 256, {"offset": 1.0}),
    "fused 32768x2048": ("fused_add_rms_norm", 32768, 4096, 2048,
                         {"offset": 1.0, "residual_sum": "rounded"}),
    "gated 2^21x128": ("rms_norm_gated", 2**21, 32768, 128,
                       {"convention": "vllm", "activation": "silu"}),
}
N_IN = {"rms_norm": 1, "fused_add_rms_norm": 2, "rms_norm_gated": 2}
# rows the backward reads as saved inputs and writes as input gradients: one for the fused
# op ("rounded": the new residual is the sum the norm read, dx = dresidual), as bench/run.py
N_SAVED = {"rms_norm": 1, "fused_add_rms_norm": 1, "rms_norm_gated": 2}
N_OUT = {"rms_norm": 1, "fused_add_rms_norm": 2, "rms_norm_gated": 1}
INTS = {torch.float32: torch.int32, BF16: torch.int16, torch.float16: torch.int16}


# --------------------------------------------------------------------------- inputs


def make_inputs(op: str, rows: int, hidden: int, device: str, seed: int):
    """Row inputs, weight and output gradients (deterministic for a given device)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    ins = [randn(rows, hidden).to(BF16) for _ in range(N_IN[op])]
    if op == "rms_norm_gated":
        weight = (1 + 0.1 * randn(hidden)).to(BF16)
    else:
        weight = (0.1 * randn(hidden)).to(BF16)
    grads = [randn(rows, hidden).to(BF16) for _ in range(N_OUT[op])]
    return ins, weight, grads


def spec_reference(op: str, ins, weight, grads, params):
    """(forward outputs, backward outputs) of the spec, in the operator's order."""
    from normspec import spec

    if op == "rms_norm":
        y = spec.rms_norm(ins[0], weight, eps=EPS, **params)
        return [y], list(spec.rms_norm_backward(grads[0], ins[0], weight, eps=EPS, **params))
    if op == "fused_add_rms_norm":
        y, res = spec.fused_add_rms_norm(ins[0], ins[1], weight, eps=EPS, **params)
        bwd = spec.fused_add_rms_norm_backward(grads[0], grads[1], ins[0], ins[1], weight,
                                               eps=EPS, **params)
        return [y, res], list(bwd)
    y = spec.rms_norm_gated(ins[0], ins[1], weight, eps=EPS, **params)
    bwd = spec.rms_norm_gated_backward(grads[0], ins[0], ins[1], weight, eps=EPS, **params)
    return [y], list(bwd)


def build_references(directory: Path) -> None:
    """Spec outputs (CPU) of the verified shape of every case, saved for the children."""
    for i, (name, (op, _, vrows, hidden, params)) in enumerate(CASES.items()):
        t0 = time.perf_counter()
        ins, weight, grads = make_inputs(op, vrows, hidden, "cpu", seed=1000 + i)
        fwd, bwd = spec_reference(op, ins, weight, grads, params)
        torch.save({"fwd": fwd, "bwd": bwd}, directory / f"ref{i}.pt")
        print(f"  spec reference {name} ({vrows}x{hidden}): {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- child


def _call(mod, op: str, ins, weight, params):
    out = getattr(mod, op)(*ins, weight, eps=EPS, **params)
    return list(out) if isinstance(out, tuple | list) else [out]


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    from normspec.spec.arithmetic import same_bits  # a NaN matches any NaN, as everywhere

    return bool(same_bits(got.detach().cpu(), want.detach().cpu()).all())


def _fingerprint(t: torch.Tensor) -> list[int]:
    """Bit-exact, order-independent fingerprint (int64 sums wrap identically)."""
    b = t.detach().contiguous().view(INTS[t.dtype]).reshape(-1).to(torch.int64)
    idx = torch.arange(b.numel(), device=b.device, dtype=torch.int64)
    weighted = b * (idx % 1000003 + 1)
    return [int(b.sum().item()), int(weighted.sum().item()),
            int((b * b).sum().item())]


def bench_ms(fn) -> float:
    """Median GPU milliseconds of fn, after an L2 flush, with the host's launch work
    hidden (bench/device_timing.py: the backward's autograd call takes longer on the
    host than do_bench's flush on the GPU, which made its timings depend on the host)."""
    return device_us(fn, rep_ms=100.0)[0] / 1e3


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def geometry(part: str, hidden: int, team: int | None, vec: int = 8, pipe: bool = True,
             row: bool = False, two_inputs: bool = False) -> str:
    """The launcher's choice for aligned rows (mirror of normspec_launch_impl.cuh, for the
    table only): ``pipe`` for the pipelined kernels, else the register / streaming ones;
    ``row`` for the forward's one-row-per-team kernel (``r``), else the persistent one
    (``p``)."""
    nvec = -(-hidden // vec)
    if pipe and row and part == "fwd":
        threads = team or min(256, max(1, _next_pow2(nvec) // (2 if two_inputs else 4)))
        fits = [n for n in (1, 2, 4) if n * threads * vec >= hidden] if threads <= 256 else []
        if fits:
            return f"r{threads}/NP{fits[0]}"
    if pipe:
        one_pass = 16 if part == "fwd" else 32
        threads = team or (_next_pow2(nvec) if nvec <= one_pass else
                           _next_pow2(nvec) // 2 if nvec <= 512 else 256)
        fits = [n for n in (1, 2, 4) if n * threads * vec >= hidden] if threads <= 256 else []
        if fits:
            return f"p{threads}/NP{fits[0]}"
    small, big = (32, 1024) if part == "fwd" else (32, 256)
    if nvec <= small:
        default = (32, 1)
    elif nvec <= big:
        default = (_next_pow2(nvec), 1)
    elif nvec <= 2 * big:
        default = (big, 2)
    elif nvec <= 4 * big:
        default = (big, 4)
    else:
        default = (1024, 0)
    threads, np_ = default
    if team and team >= 32:  # smaller teams: pipelined kernels only
        fits = [n for n in (1, 2, 4) if n * team * vec >= hidden]
        if fits:
            threads, np_ = team, fits[0]
    return f"{threads}/NP{np_}" if np_ else "stream"


def verify_case(mod, i: int, case: tuple, parts: set[str], refdir: Path) -> dict:
    """Bitwise check of the smaller call of a case against the spec references."""
    op, _, vrows, hidden, params = case
    row: dict = {}
    ref = torch.load(refdir / f"ref{i}.pt")
    ins, weight, grads = make_inputs(op, vrows, hidden, "cpu", seed=1000 + i)
    ins = [t.cuda() for t in ins]
    weight, grads = weight.cuda(), [g.cuda() for g in grads]
    if "fwd" in parts:
        with torch.no_grad():
            outs = _call(mod, op, ins, weight, params)
        row["spec_fwd_ok"] = all(
            _bits_equal(g, w) for g, w in zip(outs, ref["fwd"], strict=True))
    if "bwd" in parts:
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        wl = weight.detach().clone().requires_grad_()
        outs = _call(mod, op, leaves, wl, params)
        got = torch.autograd.grad(outs, [*leaves, wl], grads)
        row["spec_bwd_ok"] = all(
            _bits_equal(g, w) for g, w in zip(got, ref["bwd"], strict=True))
    return row


def time_case(mod, i: int, case: tuple, parts: set[str]) -> dict:
    """Times of the big call of a case, and the fingerprints of its outputs."""
    op, rows, _, hidden, params = case
    row: dict = {}
    elem = rows * hidden * 2
    n_in, n_out = N_IN[op], N_OUT[op]
    ins, weight, grads = make_inputs(op, rows, hidden, "cuda", seed=2000 + i)
    if "fwd" in parts:
        with torch.no_grad():
            row["fp_fwd"] = [_fingerprint(t) for t in _call(mod, op, ins, weight, params)]
            ms = bench_ms(lambda: _call(mod, op, ins, weight, params))
        row["fwd_us"] = ms * 1e3
        row["fwd_tbps"] = (n_in + n_out) * elem / (ms * 1e-3) / 1e12
    if "bwd" in parts:
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        wl = weight.detach().clone().requires_grad_()
        outs = _call(mod, op, leaves, wl, params)
        wrt = [*leaves, wl]
        got = torch.autograd.grad(outs, wrt, grads, retain_graph=True)
        row["fp_bwd"] = [_fingerprint(t) for t in got]
        del got
        ms = bench_ms(lambda: torch.autograd.grad(outs, wrt, grads, retain_graph=True))
        row["bwd_us"] = ms * 1e3
        row["bwd_tbps"] = (n_out + 2 * N_SAVED[op]) * elem / (ms * 1e-3) / 1e12
    return row


def child(spec_json: str) -> int:
    cfg = json.loads(spec_json)
    parts = set(cfg["parts"])
    result: dict = {"candidate": cfg["name"], "env": cfg["env"], "cases": {}}
    from normspec.backends import torch_ext

    reason = torch_ext.available()
    if reason is not None:
        raise RuntimeError(f"torch_ext unavailable: {reason}")
    refdir = Path(cfg["refdir"])
    for i, (name, case) in enumerate(CASES.items()):
        row: dict = {}
        try:
            row.update(verify_case(torch_ext, i, case, parts, refdir))
            row.update(time_case(torch_ext, i, case, parts))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        result["cases"][name] = row
        torch.cuda.empty_cache()
    print(MARK + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------- parent


def candidates(fwd: list[int], bwd: list[int], glog: list[int],
               teams: list[int] = ()) -> list[dict]:
    both = ["fwd", "bwd"]
    out = [{"name": "default", "env": {}, "parts": both},
           {"name": "pipe=0", "env": {"NORMSPEC_PIPE": "0"}, "parts": both},
           {"name": "table=0", "env": {"NORMSPEC_GATE_TABLE": "0"}, "parts": both},
           {"name": "row=0", "env": {"NORMSPEC_FWD_ROW": "0"}, "parts": ["fwd"]},
           {"name": "full=0", "env": {"NORMSPEC_FULL_ROW": "0"}, "parts": both},
           {"name": "rstd=0", "env": {"NORMSPEC_SAVED_RSTD": "0"}, "parts": ["bwd"]},
           {"name": "rowtable=0", "env": {"NORMSPEC_GATED_ROW_TABLE": "0"}, "parts": ["fwd"]}]
    out += [{"name": f"rowblock={b}", "env": {"NORMSPEC_ROW_BLOCK": str(b)}, "parts": ["fwd"]}
            for b in (32, 64, 128, 256)]
    out += [{"name": f"team={t}", "env": {"NORMSPEC_FWD_TEAM": str(t),
                                          "NORMSPEC_BWD_TEAM": str(t)}, "parts": both}
            for t in teams]
    out += [{"name": f"fwd={t}", "env": {"NORMSPEC_FWD_TEAM": str(t)}, "parts": ["fwd"]}
            for t in fwd]
    out += [{"name": f"bwd={t}", "env": {"NORMSPEC_BWD_TEAM": str(t)}, "parts": ["bwd"]}
            for t in bwd]
    out += [{"name": f"glog={g}", "env": {"NORMSPEC_BWD_GLOG": str(g)}, "parts": ["bwd"]}
            for g in glog]
    return out


def run_child(cand: dict, refdir: Path, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(cand["env"])
    cfg = dict(cand, refdir=str(refdir))
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"candidate": cand["name"], "env": cand["env"],
                "error": f"timed out after {timeout:.0f} s", "stderr_tail": err[-2000:]}
    wall = time.perf_counter() - t0
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
    if done.returncode != 0 or not lines:
        return {"candidate": cand["name"], "env": cand["env"], "wall_s": wall,
                "error": f"exit code {done.returncode}, no result",
                "stderr_tail": done.stderr[-3000:]}
    res = json.loads(lines[-1][len(MARK):])
    res["wall_s"] = wall
    res["warned"] = "normspec: ignoring" in done.stderr
    return res


def check_warning(timeout: float) -> dict:
    """An invalid value is ignored with one warning (and the default geometry)."""
    code = ("import torch; from normspec.backends import torch_ext as t; "
            "x = torch.randn(64, 2048, device='cuda').bfloat16().requires_grad_(); "
            "w = torch.zeros(2048, device='cuda', dtype=torch.bfloat16, requires_grad=True); "
            "y = t.rms_norm(x, w, eps=1e-6, offset=1.0); y.sum().backward(); "
            "t.rms_norm(x, w, eps=1e-6); torch.cuda.synchronize(); print('ok')")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update({"NORMSPEC_FWD_TEAM": "100", "NORMSPEC_BWD_TEAM": "512"})
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": "timed out"}
    warns = [ln for ln in done.stderr.splitlines() if ln.startswith("normspec: ignoring")]
    ok = (done.returncode == 0 and done.stdout.strip().endswith("ok") and len(warns) == 2
          and any("NORMSPEC_FWD_TEAM" in w for w in warns)
          and any("NORMSPEC_BWD_TEAM" in w for w in warns))
    return {"ok": ok, "returncode": done.returncode, "warnings": warns,
            "stderr_tail": "" if ok else done.stderr[-2000:]}


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, int | float) else "-"


def report(results: list[dict]) -> None:
    default = next((r for r in results if r["candidate"] == "default" and "cases" in r), None)
    print(f"\n{'candidate':<10}{'case':<18}{'fwd geom':>9}{'us':>8}{'TB/s':>6}"
          f"{'bwd geom':>10}{'us':>8}{'TB/s':>6}  bitwise (spec: vs CPU spec; big: vs default)")
    for res in results:
        if "cases" not in res:
            print(f"{res['candidate']:<10}{'(all)':<18} FAILED: {res.get('error')}")
            for ln in res.get("stderr_tail", "").splitlines()[-6:]:
                print(f"{'':<10}  {ln}")
            continue
        if res.get("warned"):
            print(f"{res['candidate']:<10}(a 'normspec: ignoring' warning was printed)")
        for name, row in res["cases"].items():
            if "error" in row:
                print(f"{res['candidate']:<10}{name:<18} error: {row['error'][:70]}")
                continue
            hidden = CASES[name][3]
            checks = []
            geoms = {}
            for part in ("fwd", "bwd"):
                var = "NORMSPEC_FWD_TEAM" if part == "fwd" else "NORMSPEC_BWD_TEAM"
                team = int(res["env"][var]) if var in res["env"] else None
                pipe = res["env"].get("NORMSPEC_PIPE") != "0"
                table = name.startswith("gated") and res["env"].get("NORMSPEC_GATE_TABLE") != "0"
                row_table = res["env"].get("NORMSPEC_GATED_ROW_TABLE") != "0"
                row_fwd = res["env"].get("NORMSPEC_FWD_ROW") != "0" and (not table or row_table)
                geoms[part] = (geometry(part, hidden, team, pipe=pipe, row=row_fwd,
                                        two_inputs=not name.startswith(("rms", "qk")))
                               if f"{part}_us" in row else "-")
                if part == "bwd" and "NORMSPEC_BWD_GLOG" in res["env"]:
                    geoms[part] += f"g{res['env']['NORMSPEC_BWD_GLOG']}"
                if f"spec_{part}_ok" in row:
                    checks.append(f"{part}:spec={'ok' if row[f'spec_{part}_ok'] else 'DIFF'}")
                if f"fp_{part}" in row and default is not None and res is not default:
                    ref = default["cases"].get(name, {}).get(f"fp_{part}")
                    same = ref is not None and ref == row[f"fp_{part}"]
                    row[f"same_as_default_{part}"] = same
                    checks.append(f"{part}:big={'ok' if same else 'DIFF'}")
            row["geometry"] = geoms
            print(f"{res['candidate']:<10}{name:<18}{geoms['fwd']:>9}"
                  f"{_fmt(row.get('fwd_us'), '8.1f')}{_fmt(row.get('fwd_tbps'), '6.2f')}"
                  f"{geoms['bwd']:>10}{_fmt(row.get('bwd_us'), '8.1f')}"
                  f"{_fmt(row.get('bwd_tbps'), '6.2f')}  {' '.join(checks)}")


def parse_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--fwd", default="64,128,256,512,1024", help="NORMSPEC_FWD_TEAM values")
    p.add_argument("--bwd", default="64,128,256", help="NORMSPEC_BWD_TEAM values")
    p.add_argument("--glog", default="2,3,4,5", help="NORMSPEC_BWD_GLOG values (0..7)")
    p.add_argument("--teams", default="", help="values for both NORMSPEC_FWD_TEAM and "
                   "NORMSPEC_BWD_TEAM (1..256 reach the pipelined kernels)")
    p.add_argument("--only", default="", help="run only these candidates (comma-separated "
                   "names, e.g. default,rstd=0)")
    p.add_argument("--timeout", type=float, default=150.0, help="per candidate, seconds")
    p.add_argument("--out", default="bench/results/sweeps/geometry_sweep.json")
    args = p.parse_args(argv)
    if args.child:
        return child(args.child)
    if not torch.cuda.is_available():
        print("geometry_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    from normspec.backends import torch_ext

    print("building / loading the torch extension ...", file=sys.stderr, flush=True)
    torch_ext.build(verbose=False)
    print(f"  ready ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="normspec_sweep_") as tmp:
        refdir = Path(tmp)
        build_references(refdir)
        only = {n for n in args.only.split(",") if n}
        for cand in candidates(parse_list(args.fwd), parse_list(args.bwd),
                               parse_list(args.glog), parse_list(args.teams)):
            if only and cand["name"] not in only:
                continue
            print(f"candidate {cand['name']} ...", file=sys.stderr, flush=True)
            res = run_child(cand, refdir, args.timeout)
            print(f"  {res.get('wall_s', 0):.0f} s" + (f"  ERROR {res['error']}"
                                                      if "error" in res else ""),
                  file=sys.stderr, flush=True)
            results.append(res)
    warning = check_warning(args.timeout)
    report(results)
    print(f"\ninvalid values (FWD=100, BWD=512) ignored with one warning each: "
          f"{'ok' if warning['ok'] else 'FAILED ' + json.dumps(warning)[:300]}")
    props = torch.cuda.get_device_properties(0)
    env = {"device_name": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "sm_count": props.multi_processor_count,
           "command": "python bench/geometry_sweep.py " + " ".join(argv or sys.argv[1:]),
           "total_s": time.perf_counter() - t_start}
    from normspec.report import git_state

    env["git"] = git_state()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "invalid_value_check": warning,
                               "candidates": results}, indent=1) + "\n")
    print(f"results in {out} ({env['total_s']:.0f} s in all)")
    keys = ("spec_fwd_ok", "spec_bwd_ok", "same_as_default_fwd", "same_as_default_bwd")
    bad = [r["candidate"] for r in results if "cases" not in r or any(
        "error" in row or any(row.get(k) is False for k in keys)
        for row in r["cases"].values())]
    if bad:
        print(f"NOT BITWISE / FAILED: {', '.join(bad)}")
    return 1 if bad or not warning["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
