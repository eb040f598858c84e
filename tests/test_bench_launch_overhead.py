"""bench/micro/launch_overhead.py's CPU-side parts: how a profile is split into calls and
each call's event time into lead, span and rest, and the order of its timing loop (GPU
calls faked; the timing itself needs a GPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from _scripts import load_script

lo = load_script("bench/micro/launch_overhead.py", "bench_launch_overhead")
K = lo.Kernel
FILL = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>"
SLEEP = "at::cuda::(anonymous namespace)::spin_kernel(long)"


def _loop(calls: list[list[tuple[str, int, int]]]) -> list:
    """The activities of the script's loop: per call a flush, a sleep (1000 ns) and the
    call's kernels (start, duration after the sleep's end), then a closing flush and sleep."""
    acts, t = [], 0
    for kernels in [*calls, None]:
        acts += [K(FILL, t, t + 500), K(SLEEP, t + 600, t + 1600)]
        t += 1600
        for name, start, dur in kernels or []:
            acts.append(K(name, t + start, t + start + dur))
        t += 10_000
    return acts


def test_split_calls_takes_what_lies_between_a_sleep_and_the_next_flush():
    acts = _loop([[("normspec_fwd_row_kernel", 300, 2000)],
                  [("triton_red_a", 250, 1500), ("triton_poi_b", 2000, 400)]])
    split = lo.split_calls(list(reversed(acts)))  # any order: sorted by start
    assert [[k.name for k in ks] for _, ks in split] == [
        ["normspec_fwd_row_kernel"], ["triton_red_a", "triton_poi_b"]]
    # each call's sleep is the one right before it
    assert [s.end_ns for s, _ in split] == [1600, 13200]
    # a call that ran nothing on the GPU has no activities, and the next flush stays out
    split = lo.split_calls(_loop([[], [("k", 300, 2000)]]))
    assert [[k.name for k in ks] for _, ks in split] == [[], ["k"]]


def test_split_calls_refuses_a_profile_of_another_loop():
    acts = _loop([[("k", 300, 2000)], [("k", 300, 2000)]])
    no_flush = [a for i, a in enumerate(acts) if i != 3]  # the second flush is gone
    with pytest.raises(ValueError, match=r"expected a flush .* got 'k'"):
        lo.split_calls(no_flush)
    with pytest.raises(ValueError, match=r"at least two 'spin_kernel' kernels .* got 1"):
        lo.split_calls(acts[:3])
    two_sleeps = [K(FILL, 0, 5), K(SLEEP, 10, 20), K(SLEEP, 30, 40)]
    with pytest.raises(ValueError, match="right before the sleep kernel at 30 ns, got nothing"):
        lo.split_calls(two_sleeps)
    # a memset counts as a flush as well as a fill kernel does
    memset = [a._replace(name="Memset (Device)") if a.name == FILL else a for a in acts]
    assert len(lo.split_calls(memset)) == 2


def test_call_parts_splits_the_event_time():
    sleep = K(SLEEP, 0, 1000)
    kernels = [K("a", 1300, 3300), K("b", 3500, 4000)]
    parts = lo.call_parts(sleep, kernels, event_us=4.0)
    assert parts["lead"] == pytest.approx(0.3)
    assert parts["span"] == pytest.approx(2.7)
    assert parts["kernels"] == pytest.approx(2.5)  # the 0.2 us gap between them is not
    assert parts["rest"] == pytest.approx(1.0)
    assert parts["names"] == ["a", "b"]
    assert lo.call_parts(sleep, [], 4.0) == {"lead": None, "span": 0.0, "kernels": 0.0,
                                            "rest": None, "names": []}


def test_median_parts_skips_missing_fields():
    parts = [{"event": 4.0, "lead": 0.3, "span": 2.0, "kernels": 2.0, "rest": 1.7},
             {"event": 5.0, "lead": None, "span": 0.0, "kernels": 0.0, "rest": None},
             {"event": 4.5, "lead": 0.5, "span": 2.2, "kernels": 2.1, "rest": 1.8}]
    med = lo.median_parts(parts)
    assert med["event"] == 4.5 and med["span"] == 2.0
    assert med["lead"] == pytest.approx(0.4) and med["rest"] == pytest.approx(1.75)
    assert lo.median_parts([{"event": 1.0, "lead": None, "span": 0.0, "kernels": 0.0,
                             "rest": None}])["lead"] is None


def test_gpu_activities_keeps_the_device_side_in_ns():
    from torch.autograd import DeviceType

    # the stub's methods are the real event's (a stub with activity_type once hid that
    # torch 2.11's events have none)
    for method in ("name", "device_type", "start_ns", "duration_ns", "is_user_annotation"):
        assert hasattr(torch._C._autograd._KinetoEvent, method), method

    def event(name, device, start, dur, activity):
        return SimpleNamespace(name=lambda: name, device_type=lambda: device,
                               start_ns=lambda: start, duration_ns=lambda: dur,
                               is_user_annotation=lambda: "annotation" in activity)

    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        events=lambda: [event("cudaLaunchKernel", DeviceType.CPU, 5, 7, "cuda_runtime"),
                        event("step 3", DeviceType.CUDA, 90, 3000, "gpu_user_annotation"),
                        event("normspec_fwd_row_kernel", DeviceType.CUDA, 100, 2176,
                              "kernel")])))
    assert lo._gpu_activities(prof) == [K("normspec_fwd_row_kernel", 100, 2276)]


def test_time_call_orders_flush_sleep_events_and_closes_the_last_call(monkeypatch):
    log = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.i = sum(1 for e in log if e.startswith("new event"))
            log.append(f"new event {self.i}")

        def record(self):
            log.append(f"record {self.i}")

        def elapsed_time(self, end):
            return 0.004 * (end.i - self.i)  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda c: log.append(f"sleep {c}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    flush = SimpleNamespace(zero_=lambda: log.append("flush"))
    times, acts = lo.time_call(lambda: log.append("call"), flush, 77, calls=2,
                               profiled=False)
    assert acts == [] and times == pytest.approx([4.0, 4.0])
    assert [e for e in log if not e.startswith("new")] == [
        "flush", "sleep 77", "record 0", "call", "record 1",
        "flush", "sleep 77", "record 2", "call", "record 3",
        "flush", "sleep 77", "sync"]


def test_main_names_bad_arguments(capsys):
    for argv, message in ((["--flush-mib", "0"], "--flush-mib: expected 1 MiB or more"),
                          (["--calls", "2"], "--calls >= 5"),
                          (["--case", "norm:64"], "--case: expected KIND:ROWS:H"),
                          (["--dtype", "float32"], "--dtype: invalid choice")):
        with pytest.raises(SystemExit) as exc:
            lo.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_main_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        lo.main(["--calls", "5"])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_main_times_each_case_before_building_the_next(monkeypatch, tmp_path, capsys):
    """torch.compile's caches are reset per case (``_calls``), so a case built before the
    previous one was timed would recompile inside the timing; and the JSON's medians."""
    log = []

    def fake_calls(case, backends, directions, dtype):
        log.append(f"build {case[1]}")
        assert dtype == torch.float16
        if case[1] == 64:  # the first case's rows are on disk before the second is built
            done = json.loads((tmp_path / "launch_overhead.json").read_text())["rows"]
            assert [r["case"] for r in done] == ["1x2048", "1x2048"]
        assert backends == ("torch_ext", "liger") and directions == ["forward"]
        return {(f"peer{i}", "forward"): (lambda i=i: log.append(f"call {case[1]} {i}"))
                for i in range(2)}

    def fake_time_call(call, flush, cycles, calls, profiled):
        call()
        assert (flush, cycles, calls) == ("flush 1", 1000, 5)
        events = [4.0 + 0.1 * i for i in range(calls)]
        if not profiled:
            return [e - 0.5 for e in events], []
        acts = _loop([[("kern", 300, 2000)]] * calls)  # lead 0.3, span 2.0
        return events, acts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(lo.dt, "sleep_cycles_per_ms", lambda: 500.0)
    monkeypatch.setattr(lo, "_flush_buffer", lambda mib: f"flush {mib}")
    monkeypatch.setattr(lo, "_calls", fake_calls)
    monkeypatch.setattr(lo, "time_call", fake_time_call)
    assert lo.main(["--case", "norm:1:2048", "--case", "norm:64:256", "--flush-mib", "1",
                    "--backend", "torch_ext", "--backend", "liger", "--direction", "forward",
                    "--dtype", "float16", "--calls", "5", "--rounds", "2",
                    "--out", str(tmp_path)]) == 0
    first_of_64 = log.index("build 64")
    assert all(e.startswith("call 1 ") for e in log[1:first_of_64])
    assert len(log[1:first_of_64]) == 2 * 5 + 2 * 2 * 2  # warm-up, then 2 rounds x 2 loops
    data = json.loads((tmp_path / "launch_overhead.json").read_text())
    assert data["cases"] == ["1x2048", "64x256"] and data["device"] == "fake GPU"
    assert data["dtype"] == "float16"
    assert [(r["case"], r["backend"]) for r in data["rows"]] == [
        ("1x2048", "peer0"), ("1x2048", "peer1"), ("64x256", "peer0"), ("64x256", "peer1")]
    row = data["rows"][0]
    assert row["event_us"] == pytest.approx(4.2) and row["event_plain_us"] == pytest.approx(3.7)
    assert row["lead_us"] == pytest.approx(0.3) and row["span_us"] == pytest.approx(2.0)
    assert row["rest_us"] == pytest.approx(1.9) and row["kernels_run"] == ["kern"]
    assert len(row["rounds"]) == 2 and row["flush_mib"] == 1
    assert "64x256: round 2 of 2 done" in capsys.readouterr().err
