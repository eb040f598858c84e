"""A complete third-party normspec backend: the textbook RMSNorm in plain torch.

It implements ``rms_norm`` (any offset) the way most model code writes it —
``x * rsqrt(mean(x²) + eps) * (offset + w)`` in fp32, cast once — with torch
autograd as its backward. normspec discovers it through the entry point in
this distribution's ``pyproject.toml``; ``normspec check --backend textbook
--op rms_norm --profile cpu_fp32`` then holds it to the spec.
"""

from __future__ import annotations

import torch

from normspec.registry import Backend, OpSupport


class TextbookBackend(Backend):
    name = "textbook"
    source = f"normspec-example-plugin 0.1.0 (plain torch {torch.__version__})"
    ops = {"rms_norm": OpSupport(backward="full", devices=("cpu", "cuda"))}

    def available(self) -> str | None:
        return None  # pure torch: runs wherever torch does

    def library_version(self) -> str:
        return torch.__version__

    def forward(self, op, rows, weight, *, eps, **params):
        x = rows["x"]
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        offset = params.get("offset", 0.0)
        return ((x32 * rstd) * (offset + weight.float())).to(x.dtype),


backend = TextbookBackend()
