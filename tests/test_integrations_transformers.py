"""The transformers integration on the CPU: sites, bits, gradients, strict counts, unpatch."""

from __future__ import annotations

import pytest
import torch

from normspec import spec
from normspec.integrations import (
    ALIGNMENTS,
    Alignment,
    AlignmentMismatchError,
    check_same,
    get_alignment,
)
from normspec.integrations.capture import (
    NormCall,
    capture,
    equality_table,
    fused_sites,
    replay_on_transformers,
)
from normspec.integrations.sites import SITE_KINDS, expected_site_counts, site_kind
from normspec.integrations.tiny_model import TINY_CONFIG, token_sequences

transformers = pytest.importorskip("transformers")
from normspec.integrations import transformers as nt  # noqa: E402
from normspec.integrations.training import train_steps  # noqa: E402

HF_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**TINY_CONFIG)).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0 if "linear_attn" not in name else 1.0, 0.1)
    return model.eval()


def _ids(count: int = 2, length: int = 12) -> torch.Tensor:
    return torch.tensor(token_sequences(count, length, TINY_CONFIG["vocab_size"]))


def _spec_output(call: NormCall, alignment: Alignment, module: torch.nn.Module) -> torch.Tensor:
    w = module.weight.detach()
    if call.kind == "gated_norm":
        x, gate = call.inputs
        return spec.rms_norm_gated(x, gate, w, eps=module.variance_epsilon,
                                   convention=alignment.gated_convention, activation="silu")
    return spec.rms_norm(call.inputs[0], w, eps=module.eps, offset=alignment.offset)


def test_site_kinds_and_expected_counts():
    assert site_kind("model.layers.3.input_layernorm") == "input_norm"
    assert site_kind("model.layers.0.post_attention_layernorm") == "post_attention_norm"
    assert site_kind("model.layers.1.self_attn.k_norm") == "qk_norm"
    assert site_kind("model.layers.2.linear_attn.norm") == "gated_norm"
    assert site_kind("model.norm") == "final_norm"
    assert site_kind("model.layers.2.mlp.gate") is None
    from transformers import Qwen3NextConfig

    counts = expected_site_counts(Qwen3NextConfig(**TINY_CONFIG))
    assert counts == {"input_norm": 4, "post_attention_norm": 4, "final_norm": 1,
                      "qk_norm": 4, "gated_norm": 2}
    assert tuple(counts) == SITE_KINDS


def test_patch_every_site_strict_and_bitwise_equal_to_spec():
    model = _model()
    report = nt.patch_model(model, strict=True)
    assert report.counts() == dict(report.expected)
    assert nt.patched_alignment(model) == ALIGNMENTS["trainer"]
    modules = dict(model.named_modules())
    with capture(model) as calls:
        model(input_ids=_ids())
    assert {c.site for c in calls} == {s.name for s in report.sites}
    for call in calls:
        want = _spec_output(call, report.alignment, modules[call.site])
        assert spec.same_bits(want, call.outputs[0]).all(), call.site


def test_transformers_own_calls_replay_through_the_patched_model_at_every_site():
    model = _model()
    with capture(model) as hf_calls:
        model(input_ids=_ids())
    nt.patch_model(model)
    replayed = replay_on_transformers(model, hf_calls)
    table = equality_table(hf_calls, replayed)
    assert set(table) == set(SITE_KINDS)
    assert all(0.0 < row["equal"] <= 1.0 for row in table.values())


def test_unpatch_restores_the_original_forward():
    model = _model()
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = nt.patch_model(model)
    modules = dict(model.named_modules())
    assert all("forward" in vars(modules[s.name]) for s in report.sites)
    assert nt.unpatch(model) is report
    assert all("forward" not in vars(modules[s.name]) for s in report.sites)
    assert nt.patched_alignment(model) is None
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert spec.same_bits(before, after).all()
    assert nt.unpatch(model) is None


def test_strict_raises_when_a_site_is_missing_and_leaves_the_model_unpatched():
    model = _model()
    model.model.layers[1].self_attn.q_norm = torch.nn.Identity()
    with pytest.raises(RuntimeError, match="strict: patched sites per kind"):
        nt.patch_model(model, strict=True)
    assert nt.patched_alignment(model) is None
    assert all("forward" not in vars(m) for m in model.modules())
    assert nt.patch_model(model).counts()["qk_norm"] == 3  # not strict: what was found


def test_rollout_alignment_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"alignment: .*rounds the residual sum"):
        nt.patch_model(_model(), alignment="rollout")
    with pytest.raises(ValueError, match=r"alignment: expected one of \['rollout', 'trainer'\]"):
        get_alignment("nonsense")
    with pytest.raises(ValueError, match="backend: expected one of"):
        nt.patch_model(_model(), backend="nonsense")


def test_alignment_mismatch_is_detected():
    assert check_same("trainer", ALIGNMENTS["trainer"]).name == "trainer"
    with pytest.raises(AlignmentMismatchError, match="differs from rollout alignment"):
        check_same("trainer", "rollout")
    with pytest.raises(AlignmentMismatchError, match="rollout side is not patched"):
        check_same("trainer", None)


def test_a_different_gated_convention_shows_in_the_site_table():
    model = _model()
    nt.patch_model(model)
    with capture(model) as calls:
        model(input_ids=_ids())
    other = Alignment("hf-weight-vllm-gate", residual_sum="rounded", gated_convention="vllm")
    nt.patch_model(model, alignment=other)
    table = equality_table(calls, replay_on_transformers(model, calls))
    assert table["gated_norm"]["equal"] < 1.0
    assert table["qk_norm"]["equal"] == 1.0


def test_fused_add_replay_is_the_rounded_sum_then_the_norm():
    model = _model()
    nt.patch_model(model)
    module = model.model.layers[0].post_attention_layernorm
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    r = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    y, res = spec.fused_add_rms_norm(x, r, module.weight.detach(), eps=module.eps, offset=1.0,
                                     residual_sum="rounded")
    call = NormCall("model.layers.0.post_attention_layernorm", "post_attention_norm",
                    (x, r), (y, res))
    assert fused_sites([call]) == {call.site}
    table = equality_table([call], replay_on_transformers(model, [call]))
    assert table["post_attention_norm"] == {"calls": 1, "elements": 640, "equal": 1.0,
                                            "residual_equal": 1.0}
    y32, _ = spec.fused_add_rms_norm(x, r, module.weight.detach(), eps=module.eps, offset=1.0,
                                     residual_sum="fp32")
    fp32_call = NormCall(call.site, call.kind, (x, r), (y32, res))
    assert equality_table([fp32_call], replay_on_transformers(model, [call])
                          )["post_attention_norm"]["equal"] < 1.0


def test_training_steps_gradients_equal_the_spec_and_loss_falls():
    model = _model()
    report = nt.patch_model(model, strict=True)
    seqs = token_sequences(2, 16, TINY_CONFIG["vocab_size"], seed=3)
    result = train_steps(model, seqs, steps=4, alignment=report.alignment, lr=3e-3)
    assert result["losses"][-1] < result["losses"][0]
    for table in result["gradients"]:
        assert set(table) == set(SITE_KINDS)
        for kind, row in table.items():
            assert row["equal"] == 1.0, (kind, row)


def test_patch_mapping_builds_normspec_classes():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.monkey_patching import (
        apply_patches,
        register_patch_mapping,
        unregister_patch_mapping,
    )

    mapping = nt.patch_mapping()
    assert set(mapping) == {"Qwen3NextRMSNorm", "Qwen3NextRMSNormGated"}
    register_patch_mapping(mapping, overwrite=True)
    try:
        with apply_patches():
            model = Qwen3NextForCausalLM(Qwen3NextConfig(**TINY_CONFIG)).to(torch.bfloat16)
    finally:
        unregister_patch_mapping(list(mapping))
    names = {type(m).__name__ for m in model.modules()}
    assert {"NormspecQwen3NextRMSNorm", "NormspecQwen3NextRMSNormGated"} <= names
    assert "Qwen3NextRMSNorm" not in names
    with capture(model) as calls:
        model(input_ids=_ids(1, 8))
    modules = dict(model.named_modules())
    for call in calls:
        want = _spec_output(call, ALIGNMENTS["trainer"], modules[call.site])
        assert spec.same_bits(want, call.outputs[0]).all(), call.site
