"""GPU-only timing of a call, for ``bench/run.py``.

``triton.testing.do_bench`` records its start event right after its L2 flush. When the
host needs longer than the flush to launch the call (Python, dispatch, the autograd
engine; on the lent H200 an autograd backward takes 0.25-0.6 ms of host time), the GPU
waits for the host and do_bench counts that wait as the call's time. :func:`device_us`
puts a sleep kernel between the flush and the start event instead, long enough for the
host to enqueue the whole call first, so that the events time the GPU alone.

The kernels between the flush and the call move the time of a launch of a few µs by a
fraction of a µs either way. ``after_flush_kernels`` (``bench/run.py
--after-flush-kernels``) adds such kernels, to see whether a ranking of small cases
survives the change.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

#: Milliseconds the sleep kernel holds the GPU before each timed call: longer than the
#: host's work for any call the bench times (the slowest seen on the H200: about 0.6 ms,
#: torch.compile's backward).
HIDE_HOST_MS = 2.0
#: Bytes written to flush L2 before every call (as do_bench: 256 MB).
FLUSH_BYTES = 256 * 2**20

_CYCLES_PER_MS: list[float] = []


def sleep_cycles_per_ms() -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on this GPU (measured once)."""
    if not _CYCLES_PER_MS:
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(cycles / start.elapsed_time(end))
    return _CYCLES_PER_MS[0]


def device_us(fn: Callable[[], object], rep_ms: float = 100.0,
              hide_host_ms: float = HIDE_HOST_MS,
              flush_bytes: int = FLUSH_BYTES,
              after_flush_kernels: int = 0) -> tuple[float, float]:
    """``fn``'s GPU time and host time per call: medians, in microseconds.

    Every call follows an L2 flush of ``flush_bytes`` (``zero_``, as in do_bench), then a
    sleep kernel of ``hide_host_ms`` while the host enqueues the call; the events around
    the call then measure the GPU's time alone. ``hide_host_ms=0`` leaves the sleep out
    (the GPU may then wait for the host inside the timed span, as in do_bench).
    ``after_flush_kernels`` no-op kernels (a sleep of one cycle each) run between the
    flush and the sleep (default none). The host
    time is how long enqueueing one call took (``perf_counter`` around it). About
    ``rep_ms`` of calls are timed (5 to 200)."""
    if hide_host_ms < 0:
        raise ValueError(f"hide_host_ms: expected >= 0 ms, got {hide_host_ms}")
    if flush_bytes < 4:
        raise ValueError(f"flush_bytes: expected at least 4 bytes, got {flush_bytes}")
    if after_flush_kernels < 0:
        raise ValueError("after_flush_kernels: expected 0 or more kernels, got "
                         f"{after_flush_kernels}")
    flush = torch.empty(flush_bytes // 4, dtype=torch.int, device="cuda")
    cycles = int(hide_host_ms * sleep_cycles_per_ms()) if hide_host_ms > 0 else 0
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once_ms = (time.perf_counter() - t0) * 1e3
    n = max(5, min(200, int(rep_ms / (hide_host_ms + once_ms))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
    host = []
    for start, end in events:
        flush.zero_()
        for _ in range(after_flush_kernels):
            torch.cuda._sleep(1)
        if cycles:
            torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
    torch.cuda.synchronize()
    gpu_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
    host_us = statistics.median(host)
    if host_us > 0.8 * hide_host_ms * 1e3:
        print(f"warning: enqueueing a call took {host_us:.0f} us, close to the "
              f"{hide_host_ms} ms sleep that hides it: its device time may include host "
              "gaps", file=sys.stderr)
    return gpu_us, host_us
