"""The bench's timing bookkeeping (no GPU needed): interleaved rounds, the median and
spread kept per row, and the rows the docs render."""

from __future__ import annotations

import sys

import pytest
from _scripts import load_script

run = load_script("bench/run.py", "bench_run")


def test_rounds_interleave_every_job_and_drop_a_failing_one():
    calls = []

    def job(name, value):
        def f():
            calls.append(name)
            return value
        return f

    def broken():
        calls.append("broken")
        raise RuntimeError("no kernel")

    jobs = {"a": job("a", 1.0), "broken": broken, "b": job("b", 2.0)}
    times, errors = run.interleaved_rounds(jobs, 3)
    assert calls == ["a", "broken", "b", "a", "b", "a", "b"]
    assert times["a"] == [1.0, 1.0, 1.0] and times["b"] == [2.0, 2.0, 2.0]
    assert errors == {"broken": "RuntimeError: no kernel"}


@pytest.mark.parametrize("times,median,spread", [
    ([2.0], 2.0, 0.0),
    ([3.0, 1.0, 2.0], 2.0, 1.0),
    ([1.0, 4.0, 2.0, 3.0], 2.5, 1.2),
])
def test_summarize_median_and_spread(times, median, spread):
    assert run.summarize(times) == pytest.approx((median, spread))


def test_rows_keep_every_round_for_the_docs():
    row = {"kind": "norm", "shape": [4, 8], "backend": "x", "forward_us": 2.0,
           "forward_us_rounds": [1.0, 2.0, 3.0], "forward_spread": 1.0, "forward_tbps": 1.0,
           "forward_copy_fraction": 0.5, "backward_us": 4.0, "backward_tbps": 0.5,
           "backward_copy_fraction": 0.25, "backward_us_rounds": [4.0], "backward_spread": 0.0}
    fwd, bwd = run.split_directions(row)
    assert fwd == {"name": "rms_norm", "shape": [4, 8], "backend": "x", "direction": "forward",
                   "us": 2.0, "tbps": 1.0, "copy_fraction": 0.5,
                   "us_rounds": [1.0, 2.0, 3.0], "spread": 1.0}
    assert bwd["direction"] == "backward" and bwd["us_rounds"] == [4.0]


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        run.main(["--rounds", "0"])


def test_time_case_rows_from_rounds_on_the_cpu(monkeypatch):
    """time_case end to end with a stand-in timer: every backend's forward and backward
    (a real autograd graph: dx and dweight) run once per round, interleaved, and each
    row keeps the median, the rounds and the spread; a failing peer becomes an error row."""
    import torch

    class Norm(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(w.float())

        def forward(self, x):
            return x * self.weight

    def broken(x):
        raise RuntimeError("no such kernel")

    ran = []
    fake = iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0, 9.0, 7.0, 8.0, 4.0, 4.0, 4.0])

    def fake_bench(fn, rep=0.0):
        out = fn()
        ran.append(type(out).__name__)
        return next(fake)

    monkeypatch.setattr(run, "peers_norm", lambda w: {"ref": Norm(w), "broken": broken})
    monkeypatch.setattr(run, "bench_ms", fake_bench)
    monkeypatch.setattr(run, "BACKEND_FILTER", ())
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    rows = run.time_case("norm", 4096, 8, bw=1.0, quick=True, device="cpu")
    ref, bad, copy = rows
    # each case starts with dynamo's caches empty, so torch.compile never hits its
    # recompile limit and falls back to eager in a later case
    assert resets == [True]
    # per round: ref fwd, ref bwd (grads of x and weight), broken fwd + bwd fail, then the
    # same-bytes copy forward and backward; three rounds
    assert ran == ["Tensor", "tuple", "Tensor", "Tensor"] * 3
    assert ref["forward_us_rounds"] == [3000.0, 4000.0, 8000.0]
    assert ref["forward_us"] == 4000.0 and ref["forward_spread"] == pytest.approx(5 / 4)
    assert ref["backward_us_rounds"] == [1000.0, 6000.0, 4000.0]
    assert ref["backward_us"] == 4000.0
    assert bad["error"] == "RuntimeError: no such kernel" and "forward_us" not in bad
    # the reference copy moves the case's bytes: forward x in, y out; backward dy, x in, dx out
    assert copy["backend"] == run.SAME_BYTES
    assert copy["forward_us_rounds"] == [2000.0, 9000.0, 4000.0]
    assert copy["backward_us_rounds"] == [5000.0, 7000.0, 4000.0]
    elem = 4096 * 8 * 2
    assert copy["forward_tbps"] == pytest.approx(2 * elem / 4000e-6 / 1e12)
    assert copy["backward_tbps"] == pytest.approx(3 * elem / 5000e-6 / 1e12)


def test_device_timing_fields_from_rounds(monkeypatch):
    """Where the device timing runs, each row also keeps the GPU-only time (median over
    the rounds), its TB/s and copy fraction, and the host time per call; the docs get
    them through split_directions."""
    import torch

    def ref(x):
        return x * 2

    calls = iter([(10.0, 20.0), (30.0, 40.0), (20.0, 30.0)] * 4)

    def fake_device_us(fn, *args, **kwargs):
        fn()
        return next(calls)

    monkeypatch.setattr(run, "peers_norm", lambda w: {"ref": ref})
    monkeypatch.setattr(run, "bench_ms", lambda fn, rep=0.0: 1.0)
    monkeypatch.setattr(run, "device_us", fake_device_us)
    monkeypatch.setattr(run, "DEVICE_TIMING", True)
    monkeypatch.setattr(run, "BACKEND_FILTER", ("ref",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rows = run.time_case("norm", 64, 8, bw=2.0, quick=True, device="cpu")
    ref_row = rows[0]
    # rounds: ref forward, copy forward (small shape, quick: no backward)
    assert ref_row["forward_us"] == 1000.0
    assert ref_row["forward_device_us"] == 20.0 and ref_row["forward_host_us"] == 30.0
    elem = 64 * 8 * 2
    assert ref_row["forward_device_tbps"] == pytest.approx(2 * elem / 20e-6 / 1e12)
    assert ref_row["forward_device_copy_fraction"] == pytest.approx(
        ref_row["forward_device_tbps"] / 2.0)
    (fwd,) = run.split_directions(ref_row)
    assert fwd["device_us"] == 20.0 and fwd["host_us"] == 30.0
    assert fwd["device_spread"] == pytest.approx(1.0)


def test_a_backend_left_out_by_the_filter_is_not_loaded(monkeypatch):
    """--backend torch_ext must not load (and NVRTC-compile) the CuPy backend."""
    loaded = []
    monkeypatch.setattr(run, "_load_torch_ext", lambda: loaded.append("torch_ext") or [])
    monkeypatch.setattr(run, "_load_cupy", lambda: loaded.append("cupy") or [])
    monkeypatch.setattr(run, "BACKEND_FILTER", ("torch_ext",))
    run._ours()
    assert loaded == ["torch_ext"]
    loaded.clear()
    monkeypatch.setattr(run, "BACKEND_FILTER", ("cupy (vllm)",))
    run._ours()
    assert loaded == ["cupy"]
    loaded.clear()
    monkeypatch.setattr(run, "BACKEND_FILTER", ())
    run._ours()
    assert loaded == ["torch_ext", "cupy"]


def test_device_timing_takes_the_flush_sleep_and_prelude_flags(monkeypatch):
    """--flush-mib, --hide-host-ms and --after-flush-kernels reach every device timing:
    probes of how the flush, the host-hiding sleep and kernels between them move a
    kernel's time."""
    import torch

    seen = []

    def fake_device_us(fn, rep, **kwargs):
        seen.append(kwargs)
        return 5.0, 6.0

    monkeypatch.setattr(run, "bench_ms", lambda fn, rep=0.0: 1.0)
    monkeypatch.setattr(run, "device_us", fake_device_us)
    monkeypatch.setattr(run, "DEVICE_TIMING", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run, "FLUSH_MIB", 512)
    monkeypatch.setattr(run, "HIDE_MS", 0.0)
    monkeypatch.setattr(run, "AFTER_FLUSH_KERNELS", 2)
    assert run.time_call(lambda: None, 10.0) == (1.0, 5.0, 6.0)
    assert seen == [{"hide_host_ms": 0.0, "flush_bytes": 512 * 2**20,
                     "after_flush_kernels": 2}]


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--flush-mib", "0", "--flush-mib must be at least 1, got 0"),
    ("--hide-host-ms", "-1", "--hide-host-ms must be 0 or more, got -1.0"),
    ("--after-flush-kernels", "-1", "--after-flush-kernels must be 0 or more, got -1"),
])
def test_timing_flags_out_of_range_are_refused(flag, value, message, capsys):
    with pytest.raises(SystemExit) as done:
        run.main([flag, value])
    assert done.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"hide_host_ms": -0.5}, "hide_host_ms: expected >= 0 ms, got -0.5"),
    ({"flush_bytes": 2}, "flush_bytes: expected at least 4 bytes, got 2"),
    ({"after_flush_kernels": -1}, "after_flush_kernels: expected 0 or more kernels, got -1"),
])
def test_device_us_refuses_a_negative_sleep_or_no_flush(kwargs, message):
    from device_timing import device_us

    with pytest.raises(ValueError, match=message):
        device_us(lambda: None, **kwargs)


def test_main_takes_after_flush_kernels_into_the_timing(monkeypatch, capsys):
    """--after-flush-kernels sets what time_call passes on (main stops at the CUDA check,
    after the flags are taken)."""
    import torch

    for name in ("BACKEND_FILTER", "ROUNDS", "DEVICE_TIMING", "FLUSH_MIB", "HIDE_MS",
                 "AFTER_FLUSH_KERNELS"):
        monkeypatch.setattr(run, name, getattr(run, name))  # restored after the test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--after-flush-kernels", "3"]) == 2
    assert run.AFTER_FLUSH_KERNELS == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_device_us_runs_the_after_flush_kernels_between_flush_and_sleep(monkeypatch):
    """The order device_us enqueues per timed call: flush, N one-cycle kernels, the
    host-hiding sleep, then the events around the call."""
    import device_timing
    import torch

    log: list = []

    class Flush:
        def zero_(self):
            log.append("flush")

    class Event:
        def record(self):
            log.append("event")

        def elapsed_time(self, other):
            return 0.004

    monkeypatch.setattr(torch, "empty", lambda *a, **k: Flush())
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: Event())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(f"sleep {cycles}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(device_timing, "sleep_cycles_per_ms", lambda: 1000.0)
    gpu_us, _ = device_timing.device_us(lambda: log.append("call"), rep_ms=1.0,
                                        hide_host_ms=2.0, after_flush_kernels=2)
    assert gpu_us == 4.0
    assert log[:2] == ["call", "call"]  # the warm-up and the host-time probe
    one = ["flush", "sleep 1", "sleep 1", "sleep 2000", "event", "call", "event"]
    assert log[2:] == one * 5


def test_the_integration_bench_runs_transformers_torch_delta_rule():
    """A GDN layer's delta rule bound from fla is rebound to transformers' torch twin (fla-core
    0.6.0 refuses its chunked backward on Hopper with Triton < 3.7.1); others stay."""
    transformers = pytest.importorskip("transformers")
    from normspec.integrations.tiny_model import TINY_CONFIG

    integration = load_script("bench/integration.py", "bench_integration")
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**TINY_CONFIG))
    layers = [m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet"]
    modeling = sys.modules[type(layers[0]).__module__]

    def from_fla(*args, **kwargs):
        raise AssertionError("the fla delta rule ran")

    from_fla.__module__ = "fla.ops.gated_delta_rule.chunk"
    layers[0].chunk_gated_delta_rule = from_fla
    own = layers[1].recurrent_gated_delta_rule = lambda *a, **k: None  # not fla's: kept
    assert integration.torch_delta_rule(model) == 1
    assert layers[0].chunk_gated_delta_rule is modeling.torch_chunk_gated_delta_rule
    assert layers[1].recurrent_gated_delta_rule is own
