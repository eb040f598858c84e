"""The large bf16 shapes of the bench for ``scripts/ncu_profile.sh``: a warm-up round,
then the round that ``ncu`` profiles (between ``torch.cuda.profiler.start`` and
``stop``; ncu runs with ``--profile-from-start off``).

Default: our kernels (rms forward and backward 32768 x 2048, q/k forward 524288 x 256,
gated forward 2^21 x 128). ``--peers``: the same forwards through ``torch.compile`` of
the transformers modules (Qwen3-Next's RMSNorm and gated RMSNorm), whose triton kernels
are the ones to compare with (the warm-up round compiles and tunes them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

EPS = 1e-6
BF16 = torch.bfloat16


def ours() -> Callable[[], None]:
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

    return one_round


def peers() -> Callable[[], None]:
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

    return one_round


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", action="store_true",
                   help="torch.compile of the transformers modules instead of ours")
    args = p.parse_args(argv)
    one_round = peers() if args.peers else ours()
    one_round()  # warm-up: builds, compiles, tunes
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    one_round()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
