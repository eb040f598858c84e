"""Time limits on a plugin's work: the main thread is interrupted, the work stays where it
runs (imports that install signal handlers, CUDA and compiler state all need that)."""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from .progress import say

__all__ = ["interrupt_after"]


@contextlib.contextmanager
def interrupt_after(seconds: float, notice: str | None = None,
                    notice_after: float | None = None) -> Iterator[Callable[[], bool]]:
    """Interrupt the main thread (``KeyboardInterrupt``) once ``seconds`` have passed, and
    yield a function that says whether that happened; say ``notice`` on stderr after
    ``notice_after`` seconds. Off the main thread there is no limit. A real SIGINT also
    ends a blocking call (a sleep, a lock); native code that never returns to Python cannot
    be interrupted so."""
    fired = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield fired.is_set
        return

    def interrupt() -> None:
        fired.set()
        if hasattr(signal, "pthread_kill"):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:  # pragma: no cover - not POSIX
            _thread.interrupt_main()

    timers = [threading.Timer(seconds, interrupt)]
    if notice is not None and notice_after is not None and notice_after < seconds:
        timers.append(threading.Timer(notice_after, say, args=(notice,)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    try:
        yield fired.is_set
    finally:
        for timer in timers:
            timer.cancel()
