"""Backend registry: discovery through the ``normspec.backends`` entry-point group.

A backend is an object (usually a [`Backend`][normspec.registry.Backend]
subclass instance) exposed by an entry point::

    [project.entry-points."normspec.backends"]
    mylib = "mylib_normspec:backend"

Built-in backends register through the same group in normspec's own
``pyproject.toml``, exactly as a third party would.

Discovery is lazy: entry points are listed by name without importing them,
and a backend's module is imported on first use. A plugin that fails to
import is reported as *broken* with its error and never breaks discovery or
other backends. Two entry points with the same name produce a warning that
says which one won. An unknown name raises an error listing the installed
ones.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from normspec.spec.validation import check_eps, check_input, check_like, check_weight

from .limits import interrupt_after
from .ops import OPS, Params
from .progress import say

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGIN_LIMIT_S",
    "Backend",
    "BackendEntry",
    "BrokenBackendError",
    "OpSupport",
    "UnknownBackendError",
    "call_limited",
    "check_registration",
    "entries",
    "get_backend",
    "installed_version",
    "iter_backends",
    "preparing",
    "register",
    "statuses",
    "unregister",
]

ENTRY_POINT_GROUP = "normspec.backends"
BackwardSupport = Literal["full", "x-only", "none"]


def installed_version(*distributions: str) -> str | None:
    """Version of the first of ``distributions`` that is installed, else ``None``.

    For a backend's ``library_version`` and ``available``; several names
    cover a library published under more than one distribution name.
    """
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class UnknownBackendError(KeyError):
    """No backend of that name is installed."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


class BrokenBackendError(RuntimeError):
    """The named backend's plugin failed to load (the message says why)."""


@dataclass(frozen=True)
class OpSupport:
    """What a backend implements of one operator.

    Attributes:
        backward: ``"full"`` (every input gradient and ``dweight``),
            ``"x-only"`` (row gradients, no ``dweight``) or ``"none"``.
        params: for each variant parameter, the values supported
            (a parameter that is absent is supported for every value).
        devices: device types the op runs on (``"cpu"``, ``"cuda"``).
        weight_dtypes: ``"fp32"`` and/or ``"same"`` (the input dtype).
    """

    backward: BackwardSupport = "full"
    params: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    devices: tuple[str, ...] = ("cpu", "cuda")
    weight_dtypes: tuple[str, ...] = ("fp32", "same")

    def unsupported(self, params: Params, device: str) -> str | None:
        """Why ``params`` on ``device`` are not supported, or ``None`` when they are."""
        if device not in self.devices:
            return f"device {device!r} not supported (supports {', '.join(self.devices)})"
        for key, allowed in self.params.items():
            if key in params and params[key] not in allowed:
                return f"{key}={params[key]!r} not supported (supports {list(allowed)})"
        return None


class Backend:
    """Base class for backends.

    Subclasses set ``name``, ``source`` and ``ops`` and implement
    [`forward`][normspec.registry.Backend.forward]. When an op's backward is
    not ``"none"``, ``forward`` must be differentiable through torch
    autograd with respect to the row inputs (and the weight for ``"full"``):
    the harness takes gradients with ``torch.autograd.grad``.
    """

    #: Registry name (``normspec check --backend NAME``).
    name: str = ""
    #: Human description of what is wrapped, with the upstream library and
    #: version, e.g. ``"transformers 5.24.0 Qwen3NextRMSNorm"``.
    source: str = ""
    #: Operator name -> what is supported.
    ops: Mapping[str, OpSupport] = {}

    def prepare(self) -> None:
        """First-use work that [`available`][normspec.registry.Backend.available] would
        otherwise start with, such as compiling kernels, for
        [`statuses`][normspec.registry.statuses] to run in a thread of its own beside the
        other backends' checks. It runs in a fresh thread, so it must not rely on that
        thread's state (its current CUDA device is device 0), and it should import nothing
        new: import what it needs with the backend's module, since other threads import
        meanwhile, and Python may hand one of two threads importing the same modules a half
        initialised one. An exception is said on stderr and otherwise left to
        ``available()``, asked afterwards, to report. The default does nothing."""

    def available(self) -> str | None:
        """``None`` when the backend can run here, else the reason it cannot."""
        return None

    def library_version(self) -> str | None:
        """Version of the wrapped library, recorded in reports."""
        return None

    def forward(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, *,
        eps: float, **params: Any,
    ) -> tuple[torch.Tensor, ...]:
        """Run ``op`` on the row inputs (named as in the op's ``row_inputs``)."""
        raise NotImplementedError

    def supports(self, op: str, params: Params, device: str) -> str | None:
        """Why this backend cannot run ``op`` with ``params`` on ``device``, or ``None``."""
        if op not in self.ops:
            return f"op {op!r} not implemented"
        return self.ops[op].unsupported(params, device)

    def check_call(
        self, op: str, rows: Mapping[str, torch.Tensor], weight: torch.Tensor, eps: float,
        params: Params,
    ) -> tuple[torch.Tensor, float]:
        """Validate a [`forward`][normspec.registry.Backend.forward] call; returns ``(x, eps)``.

        The spec's checks (``x``, the op's other row inputs shaped like ``x``,
        the weight, ``eps``), then this backend's support of ``op`` and
        ``params`` on ``x``'s device (a ``ValueError`` naming the backend).
        """
        x = check_input("x", rows.get("x"))
        reason = self.supports(op, params, x.device.type)
        if reason:
            raise ValueError(f"{self.name} backend: {reason}")
        for name in OPS[op].row_inputs[1:]:
            check_like(name, rows.get(name), x)
        check_weight(weight, x)
        return x, check_eps(eps)


@dataclass
class BackendEntry:
    """A registry entry: a name and where it comes from, loaded on demand."""

    name: str
    origin: str
    _entry_point: importlib.metadata.EntryPoint | None = None
    _backend: Backend | None = None
    _error: str | None = None

    def load(self) -> Backend | None:
        """Import the backend; on failure remember the error and return ``None``.

        The entry point's name is the backend's identity: a plugin object that calls
        itself something else is renamed (a plugin cannot pose as another backend)."""
        if self._backend is None and self._error is None and self._entry_point is not None:
            ep = self._entry_point
            try:
                obj = call_limited(ep.load, f"importing {ep.value!r}")
                backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
                if not isinstance(backend, Backend):
                    raise TypeError(
                        f"entry point {ep.value!r} gave "
                        f"{type(backend).__name__}, expected a normspec.registry.Backend"
                    )
                backend.name = self.name
                check_registration(backend)
                self._backend = backend
            # a broken plugin must never break discovery, not even by exiting
            except (Exception, SystemExit) as exc:
                last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                self._error = f"failed to load {ep.value!r}: {last}"
        return self._backend

    @property
    def broken(self) -> str | None:
        """The load error of a broken plugin, else ``None`` (loads on first call)."""
        self.load()
        return self._error

    @property
    def in_process(self) -> bool:
        """Registered in this process ([`register`][normspec.registry.register]), not
        an entry point: another process does not see it."""
        return self._entry_point is None

    def status(self) -> str | None:
        """``None`` when usable here, else why not (broken or unavailable)."""
        backend = self.load()
        if backend is None:
            return f"broken: {self._error}"
        try:
            reason = call_limited(backend.available, f"{self.name}: available()")
        except (Exception, SystemExit) as exc:
            return f"broken: available() raised {type(exc).__name__}: {exc}"
        return f"unavailable: {reason}" if reason else None


#: Seconds a plugin's import or ``available()`` may take before it counts as broken;
#: after ``PLUGIN_NOTICE_S`` a line says what is being waited for.
PLUGIN_LIMIT_S = 300.0
PLUGIN_NOTICE_S = 15.0


def call_limited(fn: Any, what: str, limit: float | None = None) -> Any:
    """``fn()``, given up with ``TimeoutError`` after ``limit`` seconds (default
    [`PLUGIN_LIMIT_S`][normspec.registry.PLUGIN_LIMIT_S]) where it runs in the main
    thread, with a line on stderr once it takes long. ``fn``'s exception (``SystemExit``
    included) is raised as it is."""
    limit = PLUGIN_LIMIT_S if limit is None else limit
    notice = (f"normspec: waiting for {what} (it has taken {PLUGIN_NOTICE_S:.0f} s; "
              f"the limit is {limit:.0f} s)")
    with interrupt_after(limit, notice, PLUGIN_NOTICE_S) as fired:
        try:
            return fn()
        except KeyboardInterrupt:
            if not fired():
                raise  # the user's Ctrl-C
            raise TimeoutError(f"{what} did not return within {limit:g} s") from None


def check_registration(backend: Backend) -> None:
    """Raise ``TypeError`` naming the backend and the field where its registration is
    malformed: ``ops`` must map known op names to ``OpSupport``, ``source`` must be a
    string."""
    ops = backend.ops
    if not isinstance(ops, Mapping):
        raise TypeError(f"backend {backend.name!r}: ops: expected a mapping of op name to "
                        f"OpSupport, got {type(ops).__name__}")
    for op, support in ops.items():
        if op not in OPS:
            raise TypeError(f"backend {backend.name!r}: ops: unknown op {op!r}; "
                            f"expected one of {sorted(OPS)}")
        if not isinstance(support, OpSupport):
            raise TypeError(f"backend {backend.name!r}: ops[{op!r}]: expected OpSupport, "
                            f"got {type(support).__name__}")
    source = backend.source
    if not isinstance(source, str):
        raise TypeError(f"backend {backend.name!r}: source: expected a string, got "
                        f"{type(source).__name__}")


_ENTRIES: dict[str, BackendEntry] | None = None
_EXTRA: dict[str, BackendEntry] = {}


def _discover() -> dict[str, BackendEntry]:
    found: dict[str, BackendEntry] = {}
    eps = sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
        key=lambda ep: (ep.dist.name if ep.dist else "", ep.name),
    )
    # normspec's own backends win a name clash, then distributions in name order
    eps.sort(key=lambda ep: (ep.dist is None or ep.dist.name != "normspec"))
    for ep in eps:
        dist = ep.dist.name if ep.dist else "?"
        origin = f"{dist} ({ep.value})"
        if ep.name in found:
            warnings.warn(
                f"normspec: duplicate backend name {ep.name!r}: {origin} is ignored, "
                f"{found[ep.name].origin} wins",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        found[ep.name] = BackendEntry(ep.name, origin, _entry_point=ep)
    return found


def entries(refresh: bool = False) -> dict[str, BackendEntry]:
    """Every known backend entry by name (entry points, then in-process registrations)."""
    global _ENTRIES
    if _ENTRIES is None or refresh:
        _ENTRIES = _discover()
    return {**_ENTRIES, **_EXTRA}


def register(backend: Backend, *, origin: str = "in-process") -> None:
    """Register a backend object in this process (tests, notebooks).

    It shadows an entry point of the same name, with a warning.
    """
    if backend.name in entries():
        warnings.warn(
            f"normspec: duplicate backend name {backend.name!r}: {origin} wins over "
            f"{entries()[backend.name].origin}",
            RuntimeWarning,
            stacklevel=2,
        )
    _EXTRA[backend.name] = BackendEntry(backend.name, origin, _backend=backend)


def unregister(name: str) -> None:
    """Remove an in-process registration."""
    _EXTRA.pop(name, None)


def get_backend(name: str) -> Backend:
    """The backend called ``name``, loaded.

    Raises:
        UnknownBackendError: no such name; the message lists the installed ones.
        BrokenBackendError: the plugin is broken (its import error is in the message).
    """
    known = entries()
    if name not in known:
        raise UnknownBackendError(
            f"backend: unknown backend {name!r}; installed: {', '.join(sorted(known)) or 'none'}"
        )
    backend = known[name].load()
    if backend is None:
        raise BrokenBackendError(f"backend {name!r} is broken: {known[name].broken}")
    return backend


def statuses(names: Sequence[str] | None = None) -> dict[str, str | None]:
    """Each named entry's [`status`][normspec.registry.BackendEntry.status] (every entry by
    default), in name order.

    The backends are imported here one after another. Then every backend's
    [`prepare`][normspec.registry.Backend.prepare] that does something (a first-use build:
    the torch extension's, the CuPy backend's NVRTC compiles) starts in a thread of its
    own, while this thread checks the backends that prepare nothing (the upstream
    libraries' imports); the prepared ones are checked last, each once its preparation
    has ended. On a fresh H200 the builds and imports took ~195 s one after another."""
    known = entries()
    chosen = sorted(set(known if names is None else names))
    for name in chosen:
        if name not in known:
            get_backend(name)  # raises, naming the installed ones
    backends = {name: known[name].load() for name in chosen}
    found: dict[str, str | None] = {}
    with preparing(backends) as futures:
        for name in chosen:
            if name not in futures:
                found[name] = known[name].status()
        for name, future in futures.items():
            future.result()
            found[name] = known[name].status()
    return {name: found[name] for name in chosen}


@contextlib.contextmanager
def preparing(backends: Mapping[str, Backend | None]) -> Iterator[dict[str, Future[None]]]:
    """Starts the [`prepare`][normspec.registry.Backend.prepare] of each of ``backends``
    (by name) that has one, each in a thread of its own, and yields their futures by name
    (a failure is said on stderr, and the future ends normally); waits for all on exit.
    [`statuses`][normspec.registry.statuses] and ``normspec build`` use it."""
    names = [name for name, backend in backends.items() if _prepares(backend)]
    with ThreadPoolExecutor(max_workers=max(1, len(names)),
                            thread_name_prefix="normspec-prepare") as pool:
        yield {name: pool.submit(_prepare, name, backends[name]) for name in names}


def _prepares(backend: object) -> bool:
    """Whether ``backend`` has a [`prepare`][normspec.registry.Backend.prepare] that does
    something (one of its own, not the base class's)."""
    method = getattr(type(backend), "prepare", None)
    return method is not None and method is not Backend.prepare


def _prepare(name: str, backend: Backend) -> None:
    try:
        backend.prepare()
    except Exception as exc:  # available() reports what it means for the backend
        say(f"normspec: {name}: prepare() raised {type(exc).__name__}: {exc} "
            "(its check follows)")


def iter_backends() -> Iterator[tuple[BackendEntry, Backend | None]]:
    """Every entry with its loaded backend (``None`` for broken ones), sorted by name."""
    for name in sorted(entries()):
        entry = entries()[name]
        yield entry, entry.load()

