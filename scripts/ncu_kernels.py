"""The large bf16 shapes of the bench (four kernels: rms forward and backward, q/k
forward, gated forward), each run twice (a warm-up round, then the round
that ``ncu`` profiles), for ``scripts/ncu_profile.sh``."""

from __future__ import annotations

import torch

from normspec.backends import torch_ext as te

EPS = 1e-6


def one_round() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32768, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.1 * torch.randn(2048, device="cuda", generator=g)).bfloat16().requires_grad_()
    y = te.rms_norm(x, w, eps=EPS, offset=1.0)
    torch.autograd.grad(y, [x, w], torch.randn_like(y))
    xq = torch.randn(524288, 256, device="cuda", generator=g).bfloat16()
    wq = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        te.rms_norm(xq, wq, eps=EPS, offset=1.0)
    xg = torch.randn(2**21, 128, device="cuda", generator=g).bfloat16()
    z = torch.randn_like(xg)
    wg = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        te.rms_norm_gated(xg, z, wg, eps=EPS, convention="vllm")
    torch.cuda.synchronize()


if __name__ == "__main__":
    te.build(verbose=False)
    one_round()
    one_round()
