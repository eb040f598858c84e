"""The normspec command line and the report's JSON shape."""

from __future__ import annotations

import json
import re

from normspec import registry
from normspec.backends.reference import ReferenceBackend
from normspec.cli import main


def test_list_shows_backends_with_availability(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "transformers" in out and "available" in out


def test_list_and_conformance_prepare_the_backends_side_by_side(tmp_path, monkeypatch,
                                                                capsys):
    """Both ask registry.statuses, which runs the first-use builds (prepare) in threads: a
    table built one backend after another would lose the overlap silently."""
    asked = []
    real = registry.statuses

    def recording(names=None):
        asked.append(None if names is None else sorted(names))
        return real(names)

    monkeypatch.setattr(registry, "statuses", recording)
    assert main(["list"]) == 0
    assert asked == [None]
    assert main(["conformance", "--device", "cpu", "--quick", "--backend", "reference",
                 "--op", "rms_norm", "--profile", "cpu_fp32", "--out", str(tmp_path)]) == 0
    assert asked[1:] == [["reference"], ["reference"]]  # the table, then run_conformance


def test_check_writes_a_report(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main(["check", "--backend", "reference", "--op", "rms_norm_gated", "--profile",
               "cpu_bf16", "--quick", "--json", str(path)])
    assert rc == 0
    assert "forward=exact gradient=exact" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["kind"] == "normspec.conformance" and report["op"] == "rms_norm_gated"
    env = report["environment"]
    for key in ("device_name", "torch", "cuda", "git", "backends", "date"):
        assert key in env
    assert set(env["git"]) == {"commit", "dirty"}
    res = report["results"]["reference"]
    assert res["backward"] == "full" and res["source"].startswith("normspec")
    gates = res["contract_gates"]
    assert gates["forward"]["passed"] and gates["forward"]["failed_lines"] == []
    assert gates["gradient"]["level"] == "exact"
    assert "singleton_aggregation" in report["checks"]["transforms"]


def test_check_prints_failing_lines_and_fails(capsys):
    rc = main(["check", "--backend", "transformers", "--op", "rms_norm", "--profile",
               "cpu_fp32", "--quick"])
    out = capsys.readouterr().out
    assert "forward=accurate" in out
    assert rc == 0  # accurate is not a failure of the contract


def test_unknown_backend_lists_the_installed_ones(capsys):
    assert main(["check", "--backend", "nope", "--op", "rms_norm", "--profile",
                 "cpu_fp32"]) == 2
    out = capsys.readouterr().out
    assert "unknown backend 'nope'" in out and "reference" in out


def test_conformance_quick_writes_reports_and_summary(tmp_path, capsys):
    rc = main(["conformance", "--device", "cpu", "--quick", "--backend", "reference",
               "--op", "rms_norm", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "normspec conformance" in out and "exact" in out
    for profile in ("cpu_fp32", "cpu_bf16"):
        report = json.loads((tmp_path / profile / "rms_norm.json").read_text())
        assert report["results"]["reference"]["level"]["forward"] == "exact"


def test_conformance_first_lists_the_backends_it_was_given(tmp_path, capsys):
    # the nox sessions run no `normspec list` before it: this table is the log's record of
    # what could run and why the others could not
    class Missing(ReferenceBackend):
        name, source = "missing-lib", "mylib 0.0 (a test's stand-in)"

        def available(self):
            return "mylib is not installed (pip install mylib)"

    registry.register(Missing())
    try:
        rc = main(["conformance", "--device", "cpu", "--quick", "--backend", "reference",
                   "--backend", "missing-lib", "--op", "rms_norm", "--profile", "cpu_fp32",
                   "--out", str(tmp_path)])
    finally:
        registry.unregister("missing-lib")
    assert rc == 0
    out = capsys.readouterr().out
    table, _, after = out.partition("cpu_fp32 rms_norm reference: forward=exact")
    assert "normspec backends" in table
    assert re.search(r"│ missing-lib\s+│ unavailable: mylib is not installed", table)
    assert re.search(r"│ reference\s+│ available\s+│ normspec", table)
    assert "transformers" not in table  # only the backends asked for
    assert "mylib" not in after  # said once, in the table


def test_conformance_with_an_unknown_backend_names_the_installed_ones(tmp_path, capsys):
    assert main(["conformance", "--device", "cpu", "--quick", "--backend", "nope",
                 "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "unknown backend 'nope'" in out and "reference" in out
    assert "normspec backends" not in out and not any(tmp_path.iterdir())


def test_public_api_is_reachable_from_the_package():
    import normspec

    backend = normspec.get_backend("reference")
    result = normspec.check(backend, "rms_norm", normspec.get_profile("cpu_fp32"), quick=True)
    assert result["level"] == {"forward": "exact", "gradient": "exact"}
    assert "rms_norm_gated" in normspec.OPS and normspec.get_op("rms_norm").row_inputs == ("x",)


def test_require_gates_the_exit_code(tmp_path, capsys):
    common = ["conformance", "--device", "cpu", "--quick", "--op", "rms_norm", "--out",
              str(tmp_path), "--backend", "reference", "--backend", "transformers"]
    assert main([*common, "--require", "reference=exact"]) == 0
    assert main([*common, "--require", "transformers=accurate"]) == 0
    assert main([*common, "--require", "transformers=exact"]) == 1
    out = capsys.readouterr().out
    assert "FAILED require transformers=exact: cpu_fp32 rms_norm forward=accurate" in out


def test_require_fails_when_the_backend_never_ran(tmp_path, capsys):
    rc = main(["conformance", "--device", "cpu", "--quick", "--op", "rms_norm", "--out",
               str(tmp_path), "--backend", "liger", "--require", "liger=accurate"])
    assert rc == 1
    assert "it ran in no report" in capsys.readouterr().out


def test_require_rejects_a_malformed_level(tmp_path, capsys):
    assert main(["conformance", "--device", "cpu", "--quick", "--out", str(tmp_path),
                 "--require", "reference=perfect"]) == 2
    assert "require: expected BACKEND=LEVEL" in capsys.readouterr().out


class _Built:
    def __init__(self, outcome):
        self.outcome = outcome

    def build(self, verbose=True):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def test_build_reports_each_backend_and_fails_when_one_fails(monkeypatch, capsys):
    """``normspec build`` builds every backend that compiles code; one that fails is named
    with its reason, the others still build, and the exit status is 1."""
    from types import SimpleNamespace

    from normspec import cli

    entries = [(SimpleNamespace(name="first"), _Built(RuntimeError("no nvcc on PATH"))),
               (SimpleNamespace(name="second"), _Built("ready in /tmp/x")),
               (SimpleNamespace(name="plain"), object())]
    monkeypatch.setattr(cli.registry, "iter_backends", lambda: iter(entries))
    assert main(["build"]) == 1
    out = capsys.readouterr().out
    assert "FAILED first: no nvcc on PATH" in out and "second: ready in /tmp/x" in out
    assert "plain" not in out
    monkeypatch.setattr(cli.registry, "iter_backends", lambda: iter(entries[1:]))
    assert main(["build"]) == 0


def test_build_prepares_every_backend_side_by_side(monkeypatch, capsys):
    """``normspec build`` starts every backend's first-use work (``prepare``) at once, as
    the torch extension's build and the CuPy backend's NVRTC compiles are on a fresh GPU
    machine: the first waits for the second's to start, which one after another never
    would. Then each ``build`` reports, in name order."""
    import threading
    from types import SimpleNamespace

    from normspec import cli

    started = threading.Event()

    class Slow(_Built):
        def prepare(self):
            self.overlapped = started.wait(2.0)

        def build(self, verbose=True):
            return "ready" if self.overlapped else "built alone"

    class Starting(_Built):
        def prepare(self):
            started.set()

    entries = [(SimpleNamespace(name="a-ext"), Slow(None)),
               (SimpleNamespace(name="b-nvrtc"), Starting("modules ready"))]
    monkeypatch.setattr(cli.registry, "iter_backends", lambda: iter(entries))
    assert main(["build"]) == 0
    out = capsys.readouterr().out
    assert out.index("a-ext: ready") < out.index("b-nvrtc: modules ready")


def test_cupy_build_is_skipped_without_cupy(monkeypatch):
    from normspec.backends import cupy as cb

    monkeypatch.setattr(cb.nvrtc, "import_cupy", lambda: (None, "CuPy is not installed (pip ...)"))
    assert cb.backend.build() == "skipped: CuPy is not installed (pip ...)"
