"""Backend discovery through entry points: lazy, robust to broken plugins, clear errors."""

from __future__ import annotations

import importlib.metadata
import threading

import pytest

from normspec import registry
from normspec.harness import check
from normspec.profiles import get_profile


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Replace the entry-point list with the real one plus the given extra EntryPoints."""
    real = importlib.metadata.entry_points

    def install(*extra):
        def fake(**kw):
            found = list(real(**kw))
            if kw.get("group") == registry.ENTRY_POINT_GROUP:
                found += list(extra)
            return found
        monkeypatch.setattr(importlib.metadata, "entry_points", fake)
        return registry.entries(refresh=True)

    yield install
    monkeypatch.undo()
    registry.entries(refresh=True)


def test_builtin_backends_are_registered_through_entry_points():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="normspec.backends")}
    assert {"reference", "transformers"} <= set(eps)
    assert eps["reference"].dist.name == "normspec"
    assert registry.get_backend("reference").source.startswith("normspec")


def test_unknown_name_lists_installed_backends():
    with pytest.raises(registry.UnknownBackendError) as info:
        registry.get_backend("no-such-backend")
    assert "no-such-backend" in str(info.value) and "reference" in str(info.value)


def test_broken_plugin_is_reported_and_never_breaks_discovery(fake_entry_points):
    broken = importlib.metadata.EntryPoint(
        "broken", "normspec_no_such_module:backend", registry.ENTRY_POINT_GROUP)
    found = fake_entry_points(broken)
    assert "broken" in found and "reference" in found
    assert "No module named 'normspec_no_such_module'" in found["broken"].status()
    assert found["reference"].status() is None
    with pytest.raises(RuntimeError, match="broken"):
        registry.get_backend("broken")
    listed = {e.name: b for e, b in registry.iter_backends()}  # listing still works
    assert listed["broken"] is None and listed["reference"] is not None


def test_wrong_object_is_reported_as_broken(fake_entry_points):
    wrong = importlib.metadata.EntryPoint("wrong", "math:pi", registry.ENTRY_POINT_GROUP)
    found = fake_entry_points(wrong)
    assert "expected a normspec.registry.Backend" in found["wrong"].status()


def test_discovery_is_lazy(fake_entry_points):
    lazy = importlib.metadata.EntryPoint(
        "lazy", "normspec_no_such_module:backend", registry.ENTRY_POINT_GROUP)
    found = fake_entry_points(lazy)
    assert found["lazy"]._backend is None and found["lazy"]._error is None  # not imported yet


def test_duplicate_names_warn_and_say_which_won(fake_entry_points):
    dup = importlib.metadata.EntryPoint(
        "reference", "normspec_example_plugin:backend", registry.ENTRY_POINT_GROUP)
    with pytest.warns(RuntimeWarning, match="duplicate backend name 'reference'.*wins"):
        found = fake_entry_points(dup)
    assert found["reference"].origin.startswith("normspec ")


def test_availability_reason_is_reported():
    class Missing(registry.Backend):
        name = "missing-lib"
        ops = {"rms_norm": registry.OpSupport()}

        def available(self):
            return "mylib is not installed (pip install mylib)"

    result = check(Missing(), "rms_norm", get_profile("cpu_fp32"), quick=True)
    assert result["level"]["forward"] == "unavailable"
    assert "pip install mylib" in result["unavailable"]


def test_third_party_plugin_is_discovered_and_checked():
    """The example plugin distribution (tests/plugins/example_plugin), installed by nox."""
    try:
        importlib.metadata.distribution("normspec-example-plugin")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("normspec-example-plugin is not installed (nox -s tests installs it)")
    entry = registry.entries(refresh=True)["textbook"]
    assert entry.origin.startswith("normspec-example-plugin")
    result = check(registry.get_backend("textbook"), "rms_norm", get_profile("cpu_fp32"),
                   quick=True)
    # the textbook formula (torch mean + rsqrt) is close to the spec but not bitwise
    assert result["level"]["forward"] in ("accurate", "invariant")
    assert result["contract_gates"]["forward"]["mismatch_lines"]


class _Building(registry.Backend):
    """A first-use build in ``prepare``: done once ``event`` is set (within two seconds)."""

    ops = {"rms_norm": registry.OpSupport()}

    def __init__(self, name: str, event: threading.Event):
        self.name, self.event, self.built = name, event, False

    def prepare(self):
        self.built = self.event.wait(2.0)

    def available(self):
        return None if self.built else "the build waited alone: no check ran beside it"


class _Setting(registry.Backend):
    ops = {"rms_norm": registry.OpSupport()}

    def __init__(self, name: str, event: threading.Event):
        self.name, self.event = name, event

    def available(self):
        self.event.set()
        return "needs a GPU"


class _Failing(registry.Backend):
    ops = {"rms_norm": registry.OpSupport()}
    name = "zz-failing"

    def prepare(self):
        raise RuntimeError("compiler missing")

    def available(self):
        return "no compiler"


def test_statuses_prepare_beside_the_other_checks(capsys):
    """``prepare`` runs in a thread while this thread checks the backends that prepare
    nothing: the first (in name order) waits on an event that a later one's check sets,
    which one after another would never see. A failing prepare is left to available()."""
    event = threading.Event()
    backends = [_Building("aa-building", event), _Setting("zz-quick", event), _Failing()]
    for b in backends:
        registry.register(b)
    try:
        assert registry.statuses(["zz-quick", "zz-failing", "aa-building"]) == {
            "aa-building": None, "zz-failing": "unavailable: no compiler",
            "zz-quick": "unavailable: needs a GPU"}
        assert capsys.readouterr().err.splitlines() == [
            "normspec: zz-failing: prepare() raised RuntimeError: compiler missing "
            "(its check follows)"]
    finally:
        for b in backends:
            registry.unregister(b.name)


def test_statuses_name_the_installed_backends_for_an_unknown_one():
    with pytest.raises(registry.UnknownBackendError, match=r"installed: .*reference"):
        registry.statuses(["no-such-backend"])


def test_our_builds_are_prepared_the_upstream_libraries_are_not():
    """The torch extension's first build (the H200: 107 s at 1130028) and the CuPy
    backend's NVRTC compiles run beside each other and the upstream libraries' imports."""
    assert registry._prepares(registry.get_backend("torch_ext"))
    assert registry._prepares(registry.get_backend("cupy"))
    assert not registry._prepares(registry.get_backend("reference"))
    assert not registry._prepares(registry.get_backend("transformers"))
