"""The provider divergence matrix (normspec.divergence, ``normspec compare``) on the CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from normspec import registry
from normspec.cli import main
from normspec.divergence import (
    PairStats,
    accumulate_pair,
    divergence_matrix,
    format_matrix,
    parse_params,
    write_heatmap,
)
from normspec.ops import OPS
from normspec.registry import Backend, OpSupport

SHAPES = [(4, 64), (3, 1)]


def _has(name: str) -> bool:
    return name in registry.entries()


class _Perturbed(Backend):
    """The spec with one element nudged by one ulp on odd seeds (a known divergence)."""

    name = "perturbed-test"
    source = "test"
    ops = {"rms_norm": OpSupport(backward="none")}

    def forward(self, op, rows, weight, *, eps, **params):
        y = OPS[op].forward(rows["x"], weight, eps=eps, **params)
        if rows["x"].shape[0] == 4 and float(rows["x"][0, 0]) != _SEED0_X00:
            y = y.clone()
            y.view(-1)[0] = torch.nextafter(y.view(-1)[0].float(), torch.tensor(10.0)).to(y.dtype)
        return (y,)


class _Crashing(Backend):
    name = "crashing-test"
    source = "test"
    ops = {"rms_norm": OpSupport(backward="none")}

    def forward(self, op, rows, weight, *, eps, **params):
        raise RuntimeError("boom")


_SEED0_X00 = float(OPS["rms_norm"].make_sample((4, 64), torch.float32, params={"offset": 1.0},
                                                seed=0).rows["x"][0, 0])


@pytest.fixture
def extra_backends():
    added = []

    def add(b: Backend) -> None:
        registry.register(b)
        added.append(b.name)

    yield add
    for name in added:
        registry.unregister(name)


def test_matrix_shape_diagonal_and_symmetry():
    r = divergence_matrix("rms_norm", "cpu_fp32", backends=["reference", "transformers"], seeds=2,
                          shapes=SHAPES)
    assert r["kind"] == "normspec.divergence"
    assert r["labels"] == ["reference", "transformers"]
    assert r["params"] == {"offset": 1.0}
    m = r["matrices"]["y"]
    for key in ("equal_percent", "differing_seeds", "differing_cases", "max_abs", "max_ulp"):
        assert len(m[key]) == 2 and all(len(row) == 2 for row in m[key])
    for i in range(2):
        assert m["equal_percent"][i][i] == 100.0
        assert m["max_ulp"][i][i] == 0 and m["differing_seeds"][i][i] == 0
    assert m["equal_percent"][0][1] == m["equal_percent"][1][0]
    assert m["max_ulp"][0][1] == m["max_ulp"][1][0]
    # torch's fp32 reduction and rsqrt are not the declared tree: transformers differs
    assert m["equal_percent"][0][1] < 100.0 and m["max_ulp"][0][1] >= 1
    assert r["participants"][1]["library_version"]
    json.dumps(r)  # JSON-ready


def test_free_conventions_split_the_reference():
    r = divergence_matrix("fused_add_rms_norm", "cpu_bf16", backends=["reference", "transformers"],
                          seeds=2, shapes=[(8, 256)])
    labels = r["labels"]
    assert labels == ["reference[residual_sum=fp32]", "reference[residual_sum=rounded]",
                      "transformers"]
    y = r["matrices"]["y"]["equal_percent"]
    # transformers rounds the residual sum first: closer to the "rounded" spec
    assert y[1][2] > y[0][2]
    assert all(v == 100.0 for row in r["matrices"]["residual_out"]["equal_percent"]
               for v in row)
    assert r["weight_dtypes"] == ["fp32", "same"]


def test_fixed_params_skip_backends_that_do_not_support_them():
    r = divergence_matrix("fused_add_rms_norm", "cpu_bf16", backends=["reference", "transformers"],
                          seeds=1, shapes=[(4, 32)], params={"residual_sum": "fp32"})
    assert r["labels"] == ["reference"]
    assert "residual_sum='fp32' not supported" in r["skipped"]["transformers"]


def test_differing_seeds_and_ulps_are_counted(extra_backends):
    extra_backends(_Perturbed())
    r = divergence_matrix("rms_norm", "cpu_fp32", backends=["reference", "perturbed-test"], seeds=3,
                          shapes=SHAPES)
    m = r["matrices"]["y"]
    assert m["differing_seeds"][0][1] == 2  # seeds 1 and 2, never seed 0
    assert m["differing_cases"][0][1] == 2
    assert m["max_ulp"][0][1] == 1
    assert 0 < m["max_abs"][0][1] < 1e-5
    total = 3 * (4 * 64 + 3 * 1)
    assert math.isclose(m["equal_percent"][0][1], 100.0 * (total - 2) / total)
    assert "perturbed-test: 2 seed(s) differ, max ulp 1" in format_matrix(r)


def test_crashing_backend_is_reported_not_compared(extra_backends):
    extra_backends(_Crashing())
    r = divergence_matrix("rms_norm", "cpu_fp32", backends=["reference", "crashing-test"], seeds=1,
                          shapes=SHAPES)
    assert r["labels"] == ["reference"]
    assert "RuntimeError: boom" in r["failed"]["crashing-test"]


@pytest.mark.skipif(not _has("textbook"), reason="example plugin not installed")
def test_textbook_plugin_joins_the_matrix():
    r = divergence_matrix("rms_norm", "cpu_bf16",
                          backends=["reference", "transformers", "textbook"], seeds=1,
                          shapes=SHAPES)
    assert r["labels"] == ["reference", "transformers", "textbook"]
    assert r["matrices"]["y"]["equal_percent"][2][2] == 100.0


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="has no parameter 'nope'"):
        divergence_matrix("rms_norm", "cpu_fp32", backends=["reference"], params={"nope": 1})
    with pytest.raises(ValueError, match="no rms_norm variant"):
        divergence_matrix("rms_norm", "cpu_fp32", backends=["reference"], params={"offset": 2.0})
    with pytest.raises(registry.UnknownBackendError, match="unknown backend"):
        divergence_matrix("rms_norm", "cpu_fp32", backends=["no-such-backend"])
    with pytest.raises(ValueError, match="seeds"):
        divergence_matrix("rms_norm", "cpu_fp32", backends=["reference"], seeds=0)


def test_parse_params():
    assert parse_params(["offset=1", "residual_sum=fp32"]) == {"offset": 1.0,
                                                                "residual_sum": "fp32"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params(["offset"])


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    r = divergence_matrix("rms_norm_gated", "cpu_bf16", backends=["reference", "transformers"],
                          seeds=1, shapes=[(4, 16)])
    path = write_heatmap(r, tmp_path / "m.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_entry_writes_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    j, p = tmp_path / "m.json", tmp_path / "m.png"
    rc = main(["compare", "--op", "rms_norm", "--profile", "cpu_fp32", "--backend", "reference",
               "--backend", "transformers", "--seeds", "1", "--quick",
               "--params", "offset=1", "--json", str(j), "--png", str(p)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "% bitwise equal" in out and "transformers" in out
    assert json.loads(j.read_text())["labels"] == ["reference", "transformers"]
    assert p.stat().st_size > 0
    assert main(["compare", "--op", "rms_norm", "--profile", "cpu_fp32",
                 "--backend", "nope"]) == 2


def test_a_signed_zero_counts_as_a_difference_in_the_matrix():
    st = PairStats()
    a = torch.tensor([-0.0, 1.0, math.nan], dtype=torch.bfloat16)
    accumulate_pair(st, a + 0.0, a, seed=3)  # only the zero's sign changes
    assert (st.numel, st.equal, st.max_ulp, st.max_abs) == (3, 2, 0, 0.0)
    assert st.seeds == {3} and st.cases_differ == 1
