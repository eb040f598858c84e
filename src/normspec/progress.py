"""Progress lines on stderr: the backends' first-use builds say what they are doing.

The builds can run side by side (the torch extension's in a thread of its own while the
CuPy backend's NVRTC compiles run in a pool of threads: [`statuses`][normspec.registry.statuses]),
so every line is written whole, under a lock: lines from two threads never run into
each other.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["announced_if_slow", "say"]

T = TypeVar("T")

_lock = threading.Lock()


def say(line: str) -> None:
    """Write ``line`` and a newline to stderr in one piece, and flush."""
    with _lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def announced_if_slow(
    work: Callable[[], T], start: str, finish: Callable[[T, float], str], *,
    after: float = 2.0,
) -> T:
    """Run ``work()`` and return what it returns, saying ``start`` once it has run for
    ``after`` seconds and then ``finish(result, seconds)`` when it ends. Work that ends
    sooner says nothing: loading a cached build is not news, compiling one is. An
    exception from ``work`` propagates (after ``finish``'s line is skipped)."""
    began = time.perf_counter()
    said = threading.Event()

    def announce() -> None:
        said.set()
        say(start)

    timer = threading.Timer(after, announce)
    timer.daemon = True
    timer.start()
    try:
        result = work()
    finally:
        timer.cancel()
        # the timer may be saying `start` right now: wait for it, so that whatever comes
        # next (`finish`, or the exception's traceback) comes after
        timer.join()
    if said.is_set():
        say(finish(result, time.perf_counter() - began))
    return result
