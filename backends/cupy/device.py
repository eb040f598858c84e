"""Per-device state: one ``DeviceState`` per device holds all the backend keeps there.

The loaded modules and kernels, the device's properties (SM count, opt-in shared memory,
whether launches may be chained), the kernels' occupancy, the global gate table and the
kept launch plans (``plans``). ``state(dev)`` gives a device's object; the tests start
afresh by replacing ``_states`` (or ``clear_launch_plans()``).
"""

from __future__ import annotations

import threading
from typing import Any

from . import driver, nvrtc
from .codes import DT_BF16, GATE_TABLE_SLOTS, OP_GATED, STATIC_SMEM_ROOM
from .launches import FILL_GATE_TABLE_KERNEL, kernel_part

_lock = threading.RLock()
#: plans kept per device before its cache starts again (shapes that vary without end, as
#: the tokens of prefills, must not grow it without bound)
_PLANS_MAX = 4096


class DeviceState:
    """What the backend keeps for device ``dev`` (filled lazily, kept for the process)."""

    def __init__(self, dev: int) -> None:
        self.dev = dev
        #: (op, dtype, part) -> (the loaded module, {name expression: lowered name})
        self.modules: dict[tuple[int, int, str], tuple[Any, dict[str, str]]] = {}
        #: (op, dtype, name expression) -> the kernel function
        self.functions: dict[tuple[int, int, str], Any] = {}
        #: a call's plan key -> its plan (``plans.plan_forward``, ``plans.plan_backward``)
        self.plans: dict[tuple, Any] = {}
        #: (op, dtype, name, shared memory) -> resident blocks per SM
        self.occupancy: dict[tuple, int] = {}
        #: the global gate table (both activations, a CuPy array) and which halves are filled
        self.gate_table: Any = None
        self.gate_tables_filled: set[bool] = set()
        self._sm_count: int | None = None
        self._smem_optin: int | None = None
        self._pdl: bool | None = None

    # ---- device properties -----------------------------------------------------------
    def sm_count(self, cp: Any) -> int:
        """The device's multiprocessors."""
        if self._sm_count is None:
            props = cp.cuda.runtime.getDeviceProperties(self.dev)
            self._sm_count = max(int(props["multiProcessorCount"]), 1)
        return self._sm_count

    def smem_optin(self, cp: Any) -> int:
        """Shared memory a block may opt in to."""
        if self._smem_optin is None:
            rt = cp.cuda.runtime
            self._smem_optin = int(
                rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, self.dev))
        return self._smem_optin

    def pdl_capable(self, cp: Any) -> bool:
        """Whether the kernels here may be chained: compiled for sm_90 or later (their
        ``griddepcontrol.wait`` is then real; the extension asks the tree kernel's
        ``ptxVersion``, which here is the NVRTC target) and a driver with
        cuLaunchKernelEx."""
        if self._pdl is None:
            arch = int(nvrtc.device_arch(cp, self.dev).partition("_")[2])
            self._pdl = arch >= 90 and driver.cu_launch_kernel_ex() is not None
        return self._pdl

    # ---- modules and kernels ---------------------------------------------------------
    def module(self, op: int, dt: int, part: str) -> tuple[Any, dict[str, str]]:
        """(op, dtype)'s ``part`` module here and its name mapping, memoised: its image
        from the disk cache, else compiled by NVRTC and cached (``nvrtc.module_image``;
        no process-wide lock is held through a compile)."""
        key = (op, dt, part)
        hit = self.modules.get(key)
        if hit is not None:
            return hit
        cp = nvrtc.require_cupy()
        image_path, mapping = nvrtc.module_image(cp, self.dev, op, dt, part)
        with _lock:
            hit = self.modules.get(key)
            if hit is None:
                with cp.cuda.Device(self.dev):
                    hit = self.modules[key] = (cp.RawModule(path=str(image_path)), mapping)
        return hit

    def kernel(self, op: int, dt: int, name: str) -> Any:
        """The kernel ``name`` (a name expression) of (op, dtype)'s module, loaded."""
        key = (op, dt, name)
        fn = self.functions.get(key)
        if fn is None:
            module, mapping = self.module(op, dt, kernel_part(name))
            driver.bind_primary_context()  # CuPy loads the module here through the driver
            with _lock:
                fn = self.functions[key] = module.get_function(mapping[name])
        return fn

    def prepare_pipe_kernel(self, fn: Any, key: tuple, block: int, smem: int,
                            optin: int) -> int:
        """Lets ``fn`` use the device's opt-in shared memory (past 48 KiB a kernel must
        ask, as ``normspec::allow_smem`` does) and returns its resident blocks per SM for
        ``block`` threads and ``smem`` bytes (kept per ``key``; 1 if the driver cannot
        tell, as in the C++ launcher: only the grid depends on it, not the bits)."""
        per_sm = self.occupancy.get(key)
        if per_sm is None:
            driver.bind_primary_context()  # the attribute and occupancy calls go to the driver
            if smem + STATIC_SMEM_ROOM > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = optin - int(fn.shared_size_bytes)
            try:
                from cupy_backends.cuda.api import driver as cuda_driver

                per_sm = int(cuda_driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    fn.kernel.ptr, block, smem))
            except Exception:  # any driver failure: the C++ launcher's fallback
                per_sm = 1
            per_sm = self.occupancy[key] = max(per_sm, 1)
        return per_sm

    def global_gate_table(self, cp: Any, sig: bool) -> int | None:
        """The address of the filled gate table of one activation (a CuPy array kept for
        the process), or ``None`` while the current stream is being captured before the
        first fill (the caller then runs the persistent forward, whose blocks build the
        table in shared memory). The first call per activation fills it on the current
        stream and waits for it."""
        half = GATE_TABLE_SLOTS * 4 if sig else 0  # bytes: the sigmoid's table comes second
        if sig in self.gate_tables_filled:
            return int(self.gate_table.data.ptr) + half
        stream = cp.cuda.get_current_stream()
        if capturing(cp, stream):  # no allocation, launch or wait inside a capture
            return None
        with _lock:
            if self.gate_table is None:
                self.gate_table = cp.empty(2 * GATE_TABLE_SLOTS, dtype=cp.float32)
        ptr = int(self.gate_table.data.ptr) + half
        driver.launch(self.kernel(OP_GATED, DT_BF16, FILL_GATE_TABLE_KERNEL),
                      (GATE_TABLE_SLOTS // 256, 1, 1), (256, 1, 1),
                      driver.KernelArgs("Qi", (ptr, int(sig))))
        stream.synchronize()
        self.gate_tables_filled.add(sig)
        return ptr

    # ---- kept launch plans -----------------------------------------------------------
    def keep_plan(self, key: tuple, plan: Any) -> Any:
        """Keeps ``plan`` for ``key`` (the cache starts again past ``_PLANS_MAX``)."""
        if len(self.plans) >= _PLANS_MAX:
            self.plans.clear()
        self.plans[key] = plan
        return plan


_states: dict[int, DeviceState] = {}


def state(dev: int) -> DeviceState:
    """Device ``dev``'s ``DeviceState`` (made at its first use)."""
    st = _states.get(dev)
    if st is None:
        with _lock:
            st = _states.setdefault(dev, DeviceState(dev))
    return st


def clear_launch_plans() -> None:
    """Forgets every device's kept plans (the tests do, before they stand in for the
    planners' device queries)."""
    for st in list(_states.values()):
        st.plans.clear()


def capturing(cp: Any, stream: Any) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph (when the runtime cannot
    tell, as if it were: the caller then takes the path that needs no table)."""
    try:
        rt = cp.cuda.runtime
        return rt.streamIsCapturing(stream.ptr) != rt.streamCaptureStatusNone
    except Exception:
        return True


def current_stream_capturing(cp: Any) -> bool:
    """Whether CuPy's current stream (torch's, inside ``TorchSide.context``) is being
    captured into a CUDA graph (``capturing``)."""
    return capturing(cp, cp.cuda.get_current_stream())


def chained_launches(cp: Any, dev: int) -> bool:
    """Whether the dweight tree's launches are chained after the backward kernel on the
    current stream, as in the extension (``normspec::chained_launches``): not on devices
    or code before sm_90, and not inside a CUDA graph capture."""
    return state(dev).pdl_capable(cp) and not current_stream_capturing(cp)
