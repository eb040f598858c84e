"""Conformance checks side by side in worker processes (``normspec conformance --jobs N``).

One task is one backend's op on one profile: the unit
[`harness.check`][normspec.harness.check] runs. Each worker is a fresh
*spawned* process (a forked one would inherit the parent's CUDA context, which
CUDA does not allow), so it imports torch, discovers the backends through their
entry points and loads each one it is given, once. The checks are the serial
run's: the same cases, seeds and gates, so a report does not depend on the
number of jobs. The workers report every finished case to the parent through a
queue, which drives the parent's progress bar. Each worker gets an equal share of the
cores for its torch CPU threads, ``NORMSPEC_WORKER_THREADS=N`` sets N instead
([`worker_threads`][normspec.workers.worker_threads]).

Spawning re-imports the main module in each worker: a script that calls
[`run_conformance`][normspec.conformance.run_conformance] with ``jobs`` above 1
must keep that call under ``if __name__ == "__main__":`` (the ``normspec``
command does).

Backends registered in the parent process only
([`registry.register`][normspec.registry.register]) do not exist in a
worker; the parent runs those itself.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

from .environ import positive_int

__all__ = ["Task", "check_in_workers", "longest_first", "usable_cores", "validate_jobs",
           "worker_threads"]


class Task(NamedTuple):
    """One check: ``backend``'s ``op`` on ``profile`` (all by name)."""

    backend: str
    op: str
    profile: str


def validate_jobs(jobs: object) -> int:
    """``jobs`` as a whole number of worker processes, at least 1."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected a whole number >= 1, got {jobs!r}")
    return jobs


def longest_first(tasks: Sequence[Task], seconds: Mapping[Task, float]) -> list[Task]:
    """``tasks`` in the order to hand them to the workers: the longest first.

    ``seconds`` are the checks' times in an earlier run (a report's
    ``check_seconds``). A check started last should be a short one, or the
    run waits for it with the other workers idle: so the checks with no time
    (new to this machine's reports) go first, in their given order, then
    the others from the longest down (the *longest processing time first*
    rule).
    """
    return sorted(tasks, key=lambda task: -seconds.get(task, math.inf))


# --- the worker side -------------------------------------------------------------------

_progress: Any = None  # the parent's progress queue, set in each worker by _start_worker


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def worker_threads(jobs: int) -> int | None:
    """Each of ``jobs`` workers' torch CPU threads (``torch.set_num_threads``).

    ``$NORMSPEC_WORKER_THREADS`` where set; otherwise the usable cores shared
    among the workers, at least one each, or ``None`` (torch's default) for a
    single worker. Left to torch, every worker would start a thread per core,
    whose small CPU ops then spin beside the other workers' Triton compiles.

    Raises:
        ValueError: ``$NORMSPEC_WORKER_THREADS`` is not a whole number >= 1
            (the message names the variable).
    """
    threads = positive_int("NORMSPEC_WORKER_THREADS",
                           "a whole number >= 1 (each worker's torch CPU threads)")
    if threads is not None or jobs == 1:
        return threads
    return max(1, usable_cores() // jobs)


def _start_worker(progress: Any, threads: int | None = None) -> None:
    global _progress
    _progress = progress
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    # Ctrl-C reaches the whole process group: the parent alone decides, and stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="normspec-orphan",
                     daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose parent died without stopping it (SIGKILL, the OOM killer) would wait for
    tasks forever, holding its GPU context: it exits once it is reparented."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _advance(_case: object) -> None:
    _progress.put(1)


def _check(task: Task, quick: bool, seeds: int | None) -> tuple[dict[str, Any], float]:
    from . import harness, registry
    from .profiles import get_profile

    start = time.perf_counter()
    backend = registry.get_backend(task.backend)  # loaded once per worker (the registry keeps it)
    result = harness.check(backend, task.op, get_profile(task.profile), quick=quick,
                           seeds=seeds, on_case=_advance)
    return result, time.perf_counter() - start


# --- the parent side -------------------------------------------------------------------

def check_in_workers(
    tasks: Sequence[Task],
    *,
    jobs: int,
    quick: bool = False,
    seeds: int | None = None,
    on_case: Callable[[], None] | None = None,
    on_result: Callable[[Task, dict[str, Any], float], None] | None = None,
    worker: Callable[[Task, bool, int | None], tuple[dict[str, Any], float]] = _check,
    fresh_process_per_task: bool = False,
) -> dict[Task, dict[str, Any]]:
    """Run ``tasks`` in ``jobs`` spawned worker processes.

    Returns each task's [`harness.check`][normspec.harness.check] result.
    ``on_case`` is called (in a thread of this process) for every case a
    worker finishes, ``on_result`` with the task, its result and its seconds
    in the worker as each result arrives. ``worker`` is the function a worker
    runs for a task (an importable module-level function; tests replace it).
    ``fresh_process_per_task``: each task in a process of its own, so that nothing one
    check leaves behind reaches another (on CUDA, a kernel's memory fault leaves the
    process's CUDA context unusable, and every later check in it would crash).

    Raises:
        RuntimeError: a check raised in its worker (the message names the task
            and the error) or a worker died (a crash of native code); the other
            tasks are cancelled.
    """
    validate_jobs(jobs)
    threads = worker_threads(jobs)
    if not tasks:
        return {}
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Queue()
    stop = threading.Event()
    callback_errors: list[BaseException] = []

    def drain() -> None:
        # no sentinel: a worker killed while writing may leave the queue's lock held; and
        # the queue is read to the end whatever on_case does, or the workers' writes block
        while True:
            try:
                progress.get(timeout=0.1)
            except queue.Empty:
                if stop.is_set():
                    return
                continue
            if on_case and not callback_errors:
                try:
                    on_case()
                except Exception as exc:
                    callback_errors.append(exc)

    reader = threading.Thread(target=drain, name="normspec-progress", daemon=True)
    reader.start()
    results: dict[Task, dict[str, Any]] = {}
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=ctx,
                               initializer=_start_worker, initargs=(progress, threads),
                               max_tasks_per_child=1 if fresh_process_per_task else None)
    finished = False
    try:
        futures = {pool.submit(worker, task, quick, seeds): task for task in tasks}
        for future in as_completed(futures):
            task = futures[future]
            try:
                results[task], seconds = future.result()
            except BrokenProcessPool as exc:
                raise RuntimeError(
                    f"a conformance worker process died (native crash or killed) while "
                    f"{len(tasks) - len(results)} checks were unfinished; rerun with --jobs 1 "
                    f"to see which check crashes (a script that runs checks with jobs > 1 "
                    f"needs an `if __name__ == '__main__':` guard)"
                ) from exc
            except Exception as exc:
                raise RuntimeError(
                    f"checking {task.backend} {task.op} on {task.profile} raised in its worker: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if on_result:
                on_result(task, results[task], seconds)
        finished = True
    finally:
        if not finished:  # an error or Ctrl-C: the running and queued checks are not awaited
            _terminate_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)
        stop.set()
        reader.join()
        progress.close()
    if callback_errors:
        raise RuntimeError(f"on_case raised {type(callback_errors[0]).__name__}: "
                           f"{callback_errors[0]}") from callback_errors[0]
    return results


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    if hasattr(pool, "terminate_workers"):  # Python 3.14
        pool.terminate_workers()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()
