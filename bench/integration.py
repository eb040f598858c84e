"""The patched transformers model on one CUDA GPU: time and gradients.

Builds a Qwen3-Next-shaped layer stack in bf16 (hidden 2048, q/k head 256,
GDN value head 128, Qwen3-Next's three linear-attention layers to one full
attention layer; dense MLPs, so the norms are not drowned by expert routing),
times forward + backward of a batch unpatched and patched with each kernel
backend (CUDA events, median of ``--iters`` after warm-up), and checks one
patched training step's norm gradients against the spec on the GPU. Prints a
table and writes JSON to ``bench/results/integration_<gpu>.json`` (or ``--out``).

The GDN layers' delta rule runs transformers' torch path in both models, also where
fla-core is installed: fla-core 0.6.0 refuses its chunked backward on Hopper GPUs with
Triton >= 3.4 and < 3.7.1 (``fla/ops/common/chunk_o.py``, ``chunk_bwd_dqkwg``). Both
models run the same delta rule, so the difference between them is the norms'.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from normspec.integrations import transformers as nt
from normspec.integrations.training import train_steps

LAYERS = ["linear_attention"] * 3 + ["full_attention"]
CONFIG = {
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5120,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
}


def _model(layers: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    types = (LAYERS * (layers // len(LAYERS) + 1))[:layers]
    config = Qwen3NextConfig(**CONFIG, num_hidden_layers=layers, layer_types=types)
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def torch_delta_rule(model) -> int:
    """Rebinds each GDN layer's delta rule that comes from fla to transformers' torch twin
    (``torch_<name>`` of the layer's modeling module; transformers binds the functions to
    the layer when it is made). Returns how many it rebound."""
    rebound = 0
    for module in model.modules():
        if not type(module).__name__.endswith("GatedDeltaNet"):
            continue
        modeling = sys.modules[type(module).__module__]
        for name in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule"):
            bound = getattr(module, name, None)
            twin = getattr(modeling, f"torch_{name}", None)
            if twin is not None and getattr(bound, "__module__", "").split(".")[0] == "fla":
                setattr(module, name, twin)
                rebound += 1
    return rebound


def _time(model, ids, iters: int) -> list[float]:
    times = []
    for i in range(iters + 3):
        model.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(input_ids=ids, labels=ids).loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", action="append", default=None,
                   help="kernel backends to patch with (default: torch_ext and cupy)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = _model(args.layers)
    torch_delta_rule(model)
    ids = torch.randint(1, CONFIG["vocab_size"], (args.batch, args.tokens), device="cuda")
    gpu = torch.cuda.get_device_name(0)
    rows = {"unpatched": _time(model, ids, args.iters)}
    gradients = {}
    for backend in args.backend or ["torch_ext", "cupy"]:
        report = nt.patch_model(model, backend=backend, strict=True)
        rows[backend] = _time(model, ids, args.iters)
        step = train_steps(model, ids[:1, :512].tolist(), steps=1, alignment=report.alignment,
                           lr=0.0)
        gradients[backend] = step["gradients"][0]
        nt.unpatch(model)
    base = statistics.median(rows["unpatched"])
    print(f"{gpu}: forward + backward of {args.layers} Qwen3-Next layers, "
          f"{args.batch} x {args.tokens} tokens, bf16")
    print(f"{'norms':<12}{'median ms':>11}{'vs unpatched':>14}  gradients bitwise = spec")
    for name, times in rows.items():
        med = statistics.median(times)
        grads = gradients.get(name)
        ok = "–" if grads is None else ("all" if all(r["equal"] == 1.0 for r in grads.values())
                                        else "NOT ALL")
        print(f"{name:<12}{med:>11.2f}{med / base:>13.3f}x  {ok}")
    result = {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
              "config": {**CONFIG, "layers": args.layers, "batch": args.batch,
                         "tokens": args.tokens},
              "delta_rule": "transformers' torch path", "times_ms": rows,
              "gradients": gradients}
    slug = gpu.replace(" ", "_").replace("/", "_")
    out = Path(args.out or f"bench/results/integration_{slug}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
