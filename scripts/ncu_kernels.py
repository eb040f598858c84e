"""The large bf16 shapes of the bench for ``scripts/ncu_profile.sh``: a warm-up round, then the
round that ``ncu`` profiles (between ``torch.cuda.profiler.start`` and ``stop``; ncu runs
with ``--profile-from-start off``).

Default: our kernels (rms forward and backward 32768 x 2048, q/k forward 524288 x 256, gated
forward 2^21 x 128; with ``--backward`` also the gated backward (vllm) and the fused forward
and backward 32768 x 2048). ``--peers``: the same work through ``torch.compile`` of the
transformers modules (Qwen3-Next's RMSNorm and gated RMSNorm), whose triton kernels are the
ones to compare with (the warm-up round compiles and tunes them). ``--fla``: FLA's rms norm
forward and its gated norm forward (and backward with ``--backward``), the fastest gated
backward in the bench. ``--small``: instead, the zero-centred norm's forward and backward
over 1, 64 and 4096 rows of 2048 and 64 rows of 256 (ours, or with ``--peers``
torch.compile's), the shapes where a launch's latency, not its bandwidth, sets the time:
ncu's kernel durations, against the bench's device time, show how much of that time is the
kernels themselves; ``--liger --small``: Liger's kernels on the same work (as
``bench/run.py`` calls them: offset 1, gemma casting), the fastest warm peer at 1 x 2048
(notes/perf.md §33). ncu's ``_rms_norm_`` filter keeps Liger's triton kernels only: the
torch kernels that its backward runs after them (the sum of its per-program dweight
partials, the cast) are not in that CSV, so its backward totals are not comparable with
ours, whose column-tree kernels are in ours. ``--gated``: instead, the gated forward 2^21 x
128 with a bf16 weight alone, ours in both conventions (vllm, then hf: their kernels'
executed instructions and stalls side by side), or with ``--peers`` torch.compile's."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

EPS = 1e-6
BF16 = torch.bfloat16


def _gated_inputs(g: torch.Generator, grad: bool):
    x = torch.randn(2**21, 128, device="cuda", generator=g).to(BF16).requires_grad_(grad)
    z = torch.randn(2**21, 128, device="cuda", generator=g).to(BF16).requires_grad_(grad)
    w = torch.ones(128, device="cuda", dtype=BF16).requires_grad_(grad)
    return x, z, w


def _backward(out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    torch.autograd.grad(out, inputs, torch.randn_like(out))


def ours(backward: bool = False) -> Callable[[], None]:
    from normspec.backends import torch_ext as te

    te.build(verbose=False)

    def one_round() -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(32768, 2048, device="cuda", generator=g).to(BF16).requires_grad_()
        w = (0.1 * torch.randn(2048, device="cuda", generator=g)).to(BF16).requires_grad_()
        y = te.rms_norm(x, w, eps=EPS, offset=1.0)
        torch.autograd.grad(y, [x, w], torch.randn_like(y))
        xq = torch.randn(524288, 256, device="cuda", generator=g).to(BF16)
        wq = torch.ones(256, device="cuda", dtype=BF16)
        with torch.no_grad():
            te.rms_norm(xq, wq, eps=EPS, offset=1.0)
        xg = torch.randn(2**21, 128, device="cuda", generator=g).to(BF16)
        z = torch.randn_like(xg)
        wg = torch.ones(128, device="cuda", dtype=BF16)
        with torch.no_grad():
            te.rms_norm_gated(xg, z, wg, eps=EPS, convention="vllm")
        if backward:
            del xg, z
            xg, z, wg = _gated_inputs(g, True)
            _backward(te.rms_norm_gated(xg, z, wg, eps=EPS, convention="vllm"), [xg, z, wg])
            del xg, z
            xf = torch.randn(32768, 2048, device="cuda", generator=g).to(BF16).requires_grad_()
            rf = torch.randn_like(xf).requires_grad_()
            y, new_res = te.fused_add_rms_norm(xf, rf, w, eps=EPS, offset=1.0,
                                               residual_sum="rounded")
            torch.autograd.grad([y, new_res], [xf, rf, w],
                                [torch.randn_like(y), torch.randn_like(new_res)])

    return one_round


#: (rows, hidden) of the small work: the decoder norm's latency-bound cases and a q/k one.
SMALL_CASES = ((1, 2048), (64, 2048), (4096, 2048), (64, 256))

Case = tuple[int, int]


def _small_round(norm_of: Callable[[Case], Callable[[torch.Tensor], torch.Tensor]],
                 weights_of: Callable[[Case], list[torch.Tensor]]) -> Callable[[], None]:
    """Forward and backward of the zero-centred norm over SMALL_CASES (bf16)."""

    def one_round() -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        for case in SMALL_CASES:
            x = torch.randn(*case, device="cuda", generator=g).to(BF16).requires_grad_()
            _backward(norm_of(case)(x), [x, *weights_of(case)])

    return one_round


def _small_weights() -> dict[int, torch.Tensor]:
    """A bf16 weight (with grad) per hidden size of SMALL_CASES."""
    return {h: (0.1 * torch.randn(h, device="cuda")).to(BF16).requires_grad_()
            for h in sorted({h for _, h in SMALL_CASES})}


def ours_small() -> Callable[[], None]:
    from normspec.backends import torch_ext as te

    te.build(verbose=False)
    w = _small_weights()
    return _small_round(lambda case: lambda x: te.rms_norm(x, w[case[1]], eps=EPS, offset=1.0),
                        lambda case: [w[case[1]]])


def peers_small() -> Callable[[], None]:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    # one module per shape, compiled for it alone (as the bench's fresh module per case)
    mods = {case: torch.compile(Qwen3NextRMSNorm(case[1], eps=EPS).to("cuda", BF16),
                                dynamic=False) for case in SMALL_CASES}
    return _small_round(lambda case: mods[case], lambda case: list(mods[case].parameters()))


def liger_small() -> Callable[[], None]:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    w = _small_weights()
    return _small_round(
        lambda case: lambda x: LigerRMSNormFunction.apply(x, w[case[1]], EPS, 1.0, "gemma",
                                                         False),
        lambda case: [w[case[1]]])


def ours_gated() -> Callable[[], None]:
    """Our gated forward 2^21 x 128 (bf16 weight, no grad), vllm then hf."""
    from normspec.backends import torch_ext as te

    te.build(verbose=False)

    def one_round() -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        xg, z, wg = _gated_inputs(g, False)
        with torch.no_grad():
            for convention in ("vllm", "hf"):
                te.rms_norm_gated(xg, z, wg, eps=EPS, convention=convention)

    return one_round


def peers_gated() -> Callable[[], None]:
    """torch.compile of the transformers gated norm, forward 2^21 x 128 (no grad)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    gated = torch.compile(Qwen3NextRMSNormGated(128, eps=EPS).to("cuda", BF16))

    def one_round() -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        xg, z, _ = _gated_inputs(g, False)
        with torch.no_grad():
            gated(xg, z)

    return one_round


def fla(backward: bool = False) -> Callable[[], None]:
    from fla.modules.fused_norm_gate import rms_norm_gated
    from fla.modules.layernorm import rms_norm

    def one_round() -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            x = torch.randn(32768, 2048, device="cuda", generator=g).to(BF16)
            rms_norm(x, torch.ones(2048, device="cuda", dtype=BF16), None, eps=EPS)
            del x
        xg, z, wg = _gated_inputs(g, backward)
        out = rms_norm_gated(xg, z, wg, None, activation="swish", eps=EPS)
        if backward:
            _backward(out, [xg, z, wg])

    return one_round


def peers(backward: bool = False) -> Callable[[], None]:
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRMSNorm,
        Qwen3NextRMSNormGated,
    )

    norm = torch.compile(Qwen3NextRMSNorm(2048, eps=EPS).to("cuda", BF16))
    qk = torch.compile(Qwen3NextRMSNorm(256, eps=EPS).to("cuda", BF16))
    gated = torch.compile(Qwen3NextRMSNormGated(128, eps=EPS).to("cuda", BF16))

    def one_round() -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():
            norm(torch.randn(32768, 2048, device="cuda", generator=g).to(BF16))
            qk(torch.randn(524288, 256, device="cuda", generator=g).to(BF16))
            xg = torch.randn(2**21, 128, device="cuda", generator=g).to(BF16)
            gated(xg, torch.randn_like(xg))
        if backward:
            del xg
            xg, z, _ = _gated_inputs(g, True)
            _backward(gated(xg, z), [xg, z, *gated.parameters()])

    return one_round


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    who = p.add_mutually_exclusive_group()
    who.add_argument("--peers", action="store_true",
                     help="torch.compile of the transformers modules instead of ours")
    who.add_argument("--fla", action="store_true", help="FLA's kernels instead of ours")
    who.add_argument("--liger", action="store_true",
                     help="Liger's kernels instead of ours (with --small only)")
    p.add_argument("--backward", action="store_true",
                   help="also the gated backward (and our fused forward and backward)")
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--small", action="store_true",
                        help="the norm's forward and backward at 1, 64 and 4096 rows of 2048 "
                             "and 64 of 256 instead")
    shapes.add_argument("--gated", action="store_true",
                        help="the gated forward 2^21 x 128 alone instead (ours: vllm and hf)")
    args = p.parse_args(argv)
    if args.liger and not args.small:
        p.error("--liger: with --small only")
    if args.gated:
        if args.fla or args.backward:
            p.error("--gated: ours or --peers only, the forward only")
        one_round = peers_gated() if args.peers else ours_gated()
    elif args.small:
        if args.fla or args.backward:
            p.error("--small: ours, --peers or --liger, forward and backward always")
        one_round = (peers_small() if args.peers else liger_small() if args.liger
                     else ours_small())
    else:
        make = peers if args.peers else fla if args.fla else ours
        one_round = make(args.backward)
    one_round()  # warm-up: builds, compiles, tunes
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    one_round()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
