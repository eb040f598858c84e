"""The train = rollout proof: one model in transformers and in vLLM, unpatched and patched.

[`run`][normspec.integrations.train_rollout.run] drives a vLLM engine in a
child process ([`rollout_worker`][normspec.integrations.rollout_worker.rollout_worker])
and a transformers model in this one, over the same checkpoint and token ids:
per-site bitwise equality of the norms both ways, per-token logprobs, and
(optionally) a few training steps whose weights are then reloaded into the
live engine, and the trained checkpoint in a fresh engine, which checks that
reload. The result is a JSON-ready dict; `normspec train-rollout` writes it.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .alignment import check_same, get_alignment
from .capture import capture, equality_table, replay_on_transformers
from .rollout_worker import rollout_worker
from .tiny_model import make_tiny_checkpoint, token_sequences
from .training import train_steps
from .transformers import patch_model
from .vllm import ALIGNMENT_ENV, BACKEND_ENV

__all__ = ["SCHEMA_VERSION", "RolloutEngine", "logprob_delta", "run", "transformers_logprobs"]

SCHEMA_VERSION = 1


class RolloutEngine:
    """The vLLM worker process, spoken to through a pipe."""

    def __init__(self, checkpoint: Path, alignment: str | None, backend: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in (ALIGNMENT_ENV, BACKEND_ENV)}
        if alignment is not None:
            env[ALIGNMENT_ENV], env[BACKEND_ENV] = alignment, backend
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=rollout_worker, args=(child, str(checkpoint), env))
        saved = os.environ.get(ALIGNMENT_ENV)
        os.environ.pop(ALIGNMENT_ENV, None)  # the child's environment is env, set there
        try:
            self.process.start()
        finally:
            if saved is not None:
                os.environ[ALIGNMENT_ENV] = saved
        self.info = self._receive()

    def _receive(self) -> Any:
        status, payload = self.conn.recv()
        if status != "ok" and status != "ready":
            self.close()
            raise RuntimeError(f"vLLM worker failed: {payload}")
        return payload

    def ask(self, command: str, payload: Any) -> Any:
        self.conn.send((command, payload))
        return self._receive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


def transformers_logprobs(model: torch.nn.Module, sequences: Sequence[Sequence[int]]
                          ) -> list[list[float]]:
    """Teacher-forced logprob of every token after the first."""
    ids = torch.tensor([list(s) for s in sequences], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return logprobs.gather(-1, ids[:, 1:, None])[..., 0].tolist()


def logprob_delta(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Max and mean |Δ logprob|, the fraction of tokens with Δ = 0, and every Δ."""
    deltas = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return {"max_abs": max(deltas), "mean_abs": sum(deltas) / len(deltas),
            "zero_fraction": sum(d == 0.0 for d in deltas) / len(deltas), "per_token": deltas}


def _sites(model, trainer_calls, rollout: dict[str, Any]) -> dict[str, Any]:
    """Per-site equality both ways: rollout calls on transformers, trainer calls on vLLM."""
    on_trainer = replay_on_transformers(model, rollout["calls"])
    return {"rollout_calls_on_trainer": equality_table(rollout["calls"], on_trainer),
            "trainer_calls_on_rollout": equality_table(trainer_calls,
                                                       rollout["replayed_trainer_calls"])}


def _phase(model, engine: RolloutEngine, sequences, max_tokens: int) -> dict[str, Any]:
    with capture(model) as trainer_calls:
        trainer = transformers_logprobs(model, sequences)
    rollout = engine.ask("rollout", (sequences, max_tokens, trainer_calls))
    return {"sites": _sites(model, trainer_calls, rollout),
            "logprobs": logprob_delta(trainer, rollout["logprobs"]),
            "trainer_logprobs": trainer, "rollout_logprobs": rollout["logprobs"],
            "rollout_calls": len(rollout["calls"]), "trainer_calls": len(trainer_calls)}


def run(checkpoint: str | Path | None = None, *, alignment: str = "trainer",
        rollout_alignment: str | None = None, backend: str = "torch_ext",
        sequences: int = 4, length: int = 32, max_tokens: int = 4, train: int = 3,
        seed: int = 0, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole proof; see the module text. ``checkpoint=None`` makes the tiny model.

    ``rollout_alignment`` (default: ``alignment``) exists to show that a
    mismatch is caught: a different name raises `AlignmentMismatchError`
    before any comparison.
    """
    from transformers import AutoModelForCausalLM

    align = get_alignment(alignment)
    rollout_name = rollout_alignment or align.name
    with tempfile.TemporaryDirectory(prefix="normspec-train-rollout-") as tmp:
        work = Path(tmp)
        if checkpoint is None:
            progress("making the tiny Qwen3-Next checkpoint")
            checkpoint = make_tiny_checkpoint(work / "tiny", seed=seed)
        checkpoint = Path(checkpoint)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
        seqs = token_sequences(sequences, length, model.config.vocab_size, seed=seed)
        report: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION, "kind": "train_rollout",
            "alignment": align.as_dict(), "backend": backend, "sequences": sequences,
            "length": length, "max_tokens": max_tokens,
            "model": {k: v for k, v in model.config.to_dict().items()
                      if k in ("hidden_size", "num_hidden_layers", "layer_types", "head_dim",
                               "linear_value_head_dim", "vocab_size", "num_experts")},
        }
        progress("unpatched: vLLM engine (its own norms) against transformers")
        engine = RolloutEngine(checkpoint, None, backend)
        try:
            report["vllm_norm_classes"] = {"unpatched": engine.info["norm_classes"]}
            report["unpatched"] = _phase(model, engine, seqs, max_tokens)
        finally:
            engine.close()
        patch = patch_model(model, alignment=align, backend=backend, strict=True)
        report["patch"] = patch.as_dict()
        progress(f"patched ({align.name}): vLLM engine with the normspec plugin")
        engine = RolloutEngine(checkpoint, rollout_name, backend)
        try:
            report["vllm_norm_classes"]["patched"] = engine.info["norm_classes"]
            check_same(align, engine.info["alignment"])
            report["patched"] = _phase(model, engine, seqs, max_tokens)
            if train:
                progress(f"training {train} steps, then syncing the weights into vLLM")
                report["training"] = train_steps(model, seqs, steps=train, alignment=align)
                model.save_pretrained(work / "trained")
                report["training"]["weight_sync"] = engine.ask("sync", str(work / "trained"))
                report["after_sync"] = _phase(model, engine, seqs, max_tokens)
        finally:
            engine.close()
        if train:
            progress("the trained checkpoint in a fresh vLLM engine (checks the in-place sync)")
            engine = RolloutEngine(work / "trained", rollout_name, backend)
            try:
                report["fresh_load"] = _phase(model, engine, seqs, max_tokens)
            finally:
                engine.close()
            report["sync_vs_fresh_load"] = logprob_delta(
                report["after_sync"]["rollout_logprobs"],
                report["fresh_load"]["rollout_logprobs"])
    return report

