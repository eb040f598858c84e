"""A vLLM engine in a process of its own, driven by messages: the rollout side of the proof.

The worker builds an in-process ``LLM`` on the CPU (the normspec plugin on
or off, as the parent's environment says), then answers: ``rollout``
(generate with prompt logprobs while capturing every norm call, and replay
the trainer's recorded calls through its own modules), ``sync`` (reload the live model's
weights from a checkpoint) and ``stop``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["rollout_worker"]


def _logprobs(request_output) -> list[float]:
    out = []
    for token, entry in zip(request_output.prompt_token_ids[1:],
                            request_output.prompt_logprobs[1:], strict=True):
        out.append(float(entry[token].logprob))
    return out


def _rollout(llm, sequences: Sequence[Sequence[int]], max_tokens: int,
             trainer_calls: list) -> dict[str, Any]:
    from vllm import SamplingParams

    from .capture import capture, fused_sites, replay_on_vllm

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=0,
                            detokenize=False)
    box: dict[str, Any] = {}

    def start(model):
        box["ctx"] = capture(model)
        box["calls"] = box["ctx"].__enter__()

    llm.apply_model(start)
    try:
        outputs = llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params,
                               use_tqdm=False)
    finally:
        llm.apply_model(lambda model: box["ctx"].__exit__(None, None, None))
    calls = box["calls"]
    fused = fused_sites(calls)
    replayed = llm.apply_model(lambda model: replay_on_vllm(model, trainer_calls, fused))[0]
    return {"calls": calls, "replayed_trainer_calls": replayed, "fused_sites": sorted(fused),
            "logprobs": [_logprobs(o) for o in outputs],
            "generated": [list(o.outputs[0].token_ids) for o in outputs]}


def _sync(llm, checkpoint: str) -> str:
    """Reload the live model's weights in place from ``checkpoint`` (vLLM's own reload path,
    which re-runs the post-load weight processing the CPU backend applies)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint})
    return "collective_rpc('reload_weights', weights_path=...)"


def rollout_worker(conn, checkpoint: str, env: dict[str, str]) -> None:
    """Process entry point: serve ``conn`` until ``stop``."""
    os.environ.update(env)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM

        from . import vllm as plugin

        # on the CPU backend gpu_memory_utilization is the share of the host's memory
        # reserved at start (0.92 by default, refused once anything else holds memory)
        llm = LLM(model=checkpoint, dtype="bfloat16", enforce_eager=True,
                  skip_tokenizer_init=True, max_model_len=512, max_num_seqs=8, seed=0,
                  gpu_memory_utilization=0.25)
        state = plugin.current()
        classes = llm.apply_model(lambda m: sorted({type(mod).__name__ for _, mod in
                                                    m.named_modules()
                                                    if "Norm" in type(mod).__name__}))[0]
        conn.send(("ready", {"alignment": None if state is None else state[0].name,
                             "backend": None if state is None else state[1],
                             "norm_classes": classes}))
        while True:
            command, payload = conn.recv()
            if command == "stop":
                break
            if command == "rollout":
                conn.send(("ok", _rollout(llm, *payload)))
            elif command == "sync":
                conn.send(("ok", _sync(llm, payload)))
    except BaseException as exc:  # reported to the parent, which raises it
        import traceback

        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()
