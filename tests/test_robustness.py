"""Off the happy path: misbehaving backends and plugins are contained and named, repro
snippets reproduce, and the command line answers user errors with one line."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from normspec import cli, harness, registry
from normspec.ops import OPS
from normspec.profiles import get_profile
from normspec.registry import Backend, BackendEntry, OpSupport

SPEC = OPS["rms_norm"]


class _Spec(Backend):
    """The spec itself, with a hook to misbehave."""

    source = "test"
    ops = {"rms_norm": OpSupport(backward="none", params={"offset": (0.0, 1.0)})}

    def forward(self, op, rows, weight, *, eps, **params):
        y = SPEC.forward(rows["x"], weight, eps=eps, **params)
        return self.twist(y if isinstance(y, tuple) else (y,), rows)

    def twist(self, out, rows):
        return out


class _TwoOutputs(_Spec):
    name = "two-outputs-test"

    def twist(self, out, rows):
        return (out[0], out[0])


class _Narrow(_Spec):
    name = "narrow-test"

    def twist(self, out, rows):
        return (out[0][..., :-1],)


class _Mutating(_Spec):
    name = "mutating-test"

    def twist(self, out, rows):
        rows["x"].mul_(2)
        return out


class _Exits(_Spec):
    name = "exits-test"

    def twist(self, out, rows):
        raise SystemExit(4)


class _NudgedWhenStrided(_Spec):
    """Exact on contiguous rows, one ulp off on column-major ones (not invariant)."""

    name = "strided-test"

    def twist(self, out, rows):
        if rows["x"].stride(-1) != 1:
            y = out[0].clone()
            y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(10.0, dtype=y.dtype))
            return (y,)
        return out


@pytest.fixture
def registered():
    added = []

    def add(b: Backend) -> Backend:
        registry.register(b)
        added.append(b.name)
        return b

    yield add
    for name in added:
        registry.unregister(name)


def _check(backend: Backend) -> dict:
    return harness.check(backend, "rms_norm", get_profile("cpu_fp32"), quick=True)


@pytest.mark.parametrize(("backend", "words"), [
    (_TwoOutputs(), ["'two-outputs-test'", "rms_norm", "expected 1 output(s) ('y',), got 2"]),
    (_Narrow(), ["'narrow-test'", "output y: expected shape", "the input x's"]),
    (_Mutating(), ["'mutating-test'", "input x was modified"]),
    (_Exits(), ["crash case=", "SystemExit: 4"]),
])
def test_a_misbehaving_backend_fails_with_a_message_that_names_it(backend, words):
    result = _check(backend)
    assert result["level"]["forward"] == "fails"
    line = result["contract_gates"]["forward"]["failed_lines"][0]
    for word in words:
        assert word in line, line


def test_other_backends_still_get_their_reports(registered, tmp_path):
    from normspec.conformance import run_conformance

    registered(_TwoOutputs())
    reports = run_conformance(device="cpu", quick=True, backends=["two-outputs-test",
                                                                  "reference"],
                              ops=["rms_norm"], profiles=["cpu_fp32"], out_dir=tmp_path)
    levels = {name: res["level"]["forward"] for name, res in reports[0]["results"].items()}
    assert levels == {"two-outputs-test": "fails", "reference": "exact"}
    written = json.loads((tmp_path / "cpu_fp32" / "rms_norm.json").read_text())
    assert written["results"]["reference"]["level"]["forward"] == "exact"


def _run_repro(code: str) -> None:
    exec(compile(code, "<repro>", "exec"), {"__name__": "repro"})


def test_the_repro_of_a_transform_failure_fails_on_that_transform(registered):
    registered(_NudgedWhenStrided())
    result = _check(registry.get_backend("strided-test"))
    assert result["level"]["forward"] == "accurate"
    repro = result["contract_gates"]["forward"]["repro"]
    assert "t.name == 'column_major'" in repro or "t.name == 'strided'" in repro
    with pytest.raises(AssertionError, match="changes under the"):
        _run_repro(repro)


def test_the_repro_of_a_crash_raises_it(registered):
    registered(_Narrow())
    repro = _check(registry.get_backend("narrow-test"))["contract_gates"]["forward"]["repro"]
    with pytest.raises(AssertionError):
        _run_repro(repro)


def test_a_gradient_repro_runs_autograd_and_compares_with_the_spec():
    from normspec.repro import repro_snippet

    case = harness.Case({"offset": 1.0}, (4, 64), "fp32", 0)
    code = repro_snippet("reference", SPEC, get_profile("cpu_fp32"), case, "gradient",
                         with_weight=True)
    assert "torch.autograd.grad" in code and "op.spec_backward" in code
    _run_repro(code)  # the spec against itself: no assertion fails
    with pytest.raises(ValueError, match="stage"):
        repro_snippet("reference", SPEC, get_profile("cpu_fp32"), case, "sideways")


# -- plugins loaded through an entry point -------------------------------------------


PLUGINS = {
    "impostor": """
        from normspec.backends.reference import backend as _ref
        class Impostor(type(_ref)):
            name = "reference"
        backend = Impostor()
    """,
    "bad_ops": """
        from normspec.registry import Backend
        class Bad(Backend):
            source = "test"
            ops = {"rms_norm": "full"}
        backend = Bad()
    """,
    "bad_source": """
        from normspec.registry import Backend, OpSupport
        class Bad(Backend):
            ops = {"rms_norm": OpSupport(backward="none")}
            @property
            def source(self):
                raise RuntimeError("no source today")
        backend = Bad()
    """,
    "exits": """
        import sys
        sys.exit(3)
    """,
    "sleeps": """
        import time
        time.sleep(30)
    """,
    "signals": """
        import signal
        signal.signal(signal.SIGUSR1, signal.getsignal(signal.SIGUSR1))  # main thread only
        from normspec.backends.reference import backend
    """,
}


@pytest.fixture
def plugin_entry(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(module: str) -> BackendEntry:
        (tmp_path / f"plugin_{module}.py").write_text(textwrap.dedent(PLUGINS[module]))
        ep = importlib.metadata.EntryPoint(name=f"{module}-plugin",
                                           value=f"plugin_{module}:backend",
                                           group=registry.ENTRY_POINT_GROUP)
        return BackendEntry(ep.name, "test", _entry_point=ep)

    return make


def test_a_plugin_is_imported_in_the_calling_thread(plugin_entry):
    """Imports that install signal handlers work only in the main thread: the time limit
    interrupts it instead of moving the import elsewhere."""
    entry = plugin_entry("signals")
    assert entry.load() is not None, entry.broken


def test_the_entry_point_name_is_the_backend_s_identity(plugin_entry):
    backend = plugin_entry("impostor").load()
    assert backend is not None and backend.name == "impostor-plugin"


@pytest.mark.parametrize(("module", "words"), [
    ("bad_ops", "ops['rms_norm']: expected OpSupport, got str"),
    ("bad_source", "RuntimeError: no source today"),
    ("exits", "SystemExit: 3"),
])
def test_a_malformed_plugin_is_broken_not_fatal(plugin_entry, module, words):
    entry = plugin_entry(module)
    assert entry.load() is None
    assert words in entry.broken
    assert entry.status().startswith("broken: ")


def test_a_plugin_that_hangs_is_given_up_after_the_limit(plugin_entry, monkeypatch, capsys):
    monkeypatch.setattr(registry, "PLUGIN_LIMIT_S", 0.5)
    monkeypatch.setattr(registry, "PLUGIN_NOTICE_S", 0.1)
    entry = plugin_entry("sleeps")
    assert entry.load() is None
    assert "did not return within" in entry.broken
    assert "waiting for importing" in capsys.readouterr().err


# -- the command line ----------------------------------------------------------------


def _main(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_cuda_without_a_gpu_is_one_error_line(capsys):
    rc, out = _main(capsys, "check", "--backend", "reference", "--op", "rms_norm",
                    "--profile", "cuda_bf16")
    assert rc == 2 and out.startswith("error: --profile: needs a CUDA GPU")
    rc, out = _main(capsys, "conformance", "--device", "cuda")
    assert rc == 2 and out.count("\n") == 1 and "--device: needs a CUDA GPU" in out


def test_an_output_path_through_a_file_is_refused_before_the_work(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, out = _main(capsys, "check", "--backend", "reference", "--op", "rms_norm",
                    "--profile", "cpu_fp32", "--json", str(blocker / "r.json"))
    assert rc == 2 and "is a file, not a directory" in out and "forward=" not in out
    rc, out = _main(capsys, "conformance", "--out", str(blocker), "--backend", "reference")
    assert rc == 2 and "--out: expected a directory" in out


def test_png_without_matplotlib_is_refused_before_the_work(capsys, monkeypatch, tmp_path):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rc, out = _main(capsys, "compare", "--op", "rms_norm", "--profile", "cpu_fp32",
                    "--png", str(tmp_path / "m.png"))
    assert rc == 2 and "needs matplotlib" in out and "bitwise" not in out


@pytest.mark.parametrize("seeds", ["0", "-3", "two"])
def test_seeds_must_be_a_positive_integer(capsys, seeds):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--backend", "reference", "--op", "rms_norm", "--profile",
                  "cpu_fp32", "--seeds", seeds])
    assert exit_.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_a_check_that_ran_nothing_exits_non_zero_with_its_reason(capsys, registered):
    class _NoOffsetZero(_Spec):
        name = "offset-one-only-test"
        ops = {"rms_norm": OpSupport(backward="none", params={"offset": (1.0,)},
                                     devices=("cuda",))}

    registered(_NoOffsetZero())
    rc, out = _main(capsys, "check", "--backend", "offset-one-only-test", "--op", "rms_norm",
                    "--profile", "cpu_fp32")
    assert rc == 2 and "error: nothing was checked:" in out


def test_version_and_python_dash_m(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("normspec 0.")
    done = subprocess.run([sys.executable, "-m", "normspec", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    for word in ("compare", "examples:", "exit status:", "exact", "train-rollout"):
        assert word in done.stdout
    assert "``" not in done.stdout


def test_install_hints_in_brackets_survive_the_console(registered, capsys):
    class _Hint(_Spec):
        name = "hint-test"

        def available(self):
            return "pip install 'thing[pytorch]'"

    registered(_Hint())
    console = cli.Console(width=300)
    with console.capture() as cap:
        console.print(cli._backends_table(["hint-test"]))
    assert "thing[pytorch]" in cap.get()


def test_conformance_explains_its_failed_lines_and_names_the_backend(registered, capsys,
                                                                      tmp_path):
    registered(_TwoOutputs())
    rc, out = _main(capsys, "conformance", "--device", "cpu", "--quick", "--backend",
                    "two-outputs-test", "--op", "rms_norm", "--profile", "cpu_fp32",
                    "--out", str(tmp_path))
    assert rc == 0  # no --require: the levels are reported, not judged
    assert "failed checks (up to 5" in out and "'crash' lines" in out
    assert "cpu_fp32 two-outputs-test: crash case=" in out


def test_check_on_a_broken_plugin_is_one_error_line(plugin_entry, monkeypatch, capsys):
    entry = plugin_entry("bad_ops")
    known = registry.entries()
    monkeypatch.setattr(registry, "entries", lambda refresh=False: {**known, entry.name: entry})
    rc, out = _main(capsys, "check", "--backend", entry.name, "--op", "rms_norm",
                    "--profile", "cpu_fp32")
    assert rc == 2 and out.startswith("error: backend 'bad_ops-plugin' is broken")
    assert "Traceback" not in out


def test_check_names_the_variants_it_skipped(registered, capsys):
    class _OffsetOne(_Spec):
        name = "offset-one-test"
        ops = {"rms_norm": OpSupport(backward="none", params={"offset": (1.0,)})}

    registered(_OffsetOne())
    rc, out = _main(capsys, "check", "--backend", "offset-one-test", "--op", "rms_norm",
                    "--profile", "cpu_fp32", "--quick")
    assert rc == 0 and "skipped offset=0.0:" in out


class _Sleeps(_Spec):
    name = "sleeps-test"

    def twist(self, out, rows):
        import time

        time.sleep(30)
        return out


def test_a_case_that_hangs_is_a_crash_after_the_limit(monkeypatch):
    monkeypatch.setattr(harness, "CASE_LIMIT_S", 0.5)
    result = harness.check(_Sleeps(), "rms_norm", get_profile("cpu_fp32"), quick=True,
                           seeds=1)
    assert result["level"]["forward"] == "fails"
    assert "did not finish within 0.5 s" in result["contract_gates"]["forward"]["failed_lines"][0]


def test_a_partial_run_never_drops_backends_from_existing_reports(capsys, tmp_path):
    """Reports are rewritten whole: a run of one backend into a folder whose reports hold
    others is refused up front, naming what it would drop."""
    assert _main(capsys, "conformance", "--device", "cpu", "--quick", "--backend", "reference",
                 "--backend", "torch_ext", "--op", "rms_norm", "--profile", "cpu_fp32",
                 "--out", str(tmp_path))[0] == 0
    report = tmp_path / "cpu_fp32" / "rms_norm.json"
    before = report.read_text()
    rc, out = _main(capsys, "conformance", "--device", "cpu", "--quick", "--backend",
                    "reference", "--op", "rms_norm", "--profile", "cpu_fp32",
                    "--out", str(tmp_path))
    assert rc == 2 and out.startswith(f"error: --out: {report} holds torch_ext")
    assert report.read_text() == before
