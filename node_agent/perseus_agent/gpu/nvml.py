"""The production GPU backend: NVML through the ``nvidia-ml-py`` bindings (module ``pynvml``).

This is the only module of the project that touches ``pynvml``: every NVML error is turned
into a :mod:`perseus_agent.errors` exception here, by NVML error code, keeping the GPU index
and NVML's own message.

The bindings are imported when a backend is created rather than with this module, so the
rest of the agent (and its tests) can import it on machines without ``nvidia-ml-py``.

Setters skip changes that would not change anything. What counts as the current state is
what *this* backend locked: NVML cannot say whether a clock is "locked" (only the current
clock, which also moves with load and temperature). A lock left behind by another process
(for instance an agent that was SIGKILLed) is therefore invisible to ``reset_sm_clock`` and
``reset_memory_clock``; :meth:`NvmlBackend.force_reset_clocks` clears it. Power limits are
different: NVML reads the limit in force, so their no-op check asks NVML (in milliwatts, NVML's
unit), and any process's limit is seen.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from perseus_agent.errors import (
    GpuError,
    GpuInvalidArgumentError,
    GpuLibraryNotFoundError,
    GpuLostError,
    GpuNoPermissionError,
    GpuNotFoundError,
    GpuNotSupportedError,
)
from perseus_agent.gpu.base import GpuBackend, GpuInfo, PowerLimitRange, check_power_limit

__all__ = ["NvmlBackend"]

logger = logging.getLogger(__name__)

NVML_LIBRARY = "libnvidia-ml.so.1"

# NVML return codes (nvml.h, ``nvmlReturn_t``: part of the library's ABI, stable across driver
# versions). Spelled out here so the mapping does not need the bindings to be importable.
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_UNKNOWN = 999

NVML_CLOCK_SM = 1
# nvmlClockId_t
NVML_CLOCK_ID_APP_CLOCK_TARGET = 1
NVML_CLOCK_ID_APP_CLOCK_DEFAULT = 2

_ERROR_CLASSES: dict[int, type[GpuError]] = {
    NVML_ERROR_NO_PERMISSION: GpuNoPermissionError,
    NVML_ERROR_NOT_SUPPORTED: GpuNotSupportedError,
    # A function missing from the installed library: the driver is older than the feature.
    NVML_ERROR_FUNCTION_NOT_FOUND: GpuNotSupportedError,
    NVML_ERROR_GPU_IS_LOST: GpuLostError,
    # Unusable until the GPU is reset: to the agent, as gone as a lost GPU.
    NVML_ERROR_RESET_REQUIRED: GpuLostError,
    # NVML answers UNKNOWN for a GPU that stopped responding (e.g. Xid 79, fallen off the
    # bus) before it reports GPU_IS_LOST; nothing else in practice produces it.
    NVML_ERROR_UNKNOWN: GpuLostError,
    NVML_ERROR_INVALID_ARGUMENT: GpuInvalidArgumentError,
    NVML_ERROR_FREQ_NOT_SUPPORTED: GpuInvalidArgumentError,
    NVML_ERROR_NOT_FOUND: GpuNotFoundError,
    NVML_ERROR_GPU_NOT_FOUND: GpuNotFoundError,
    NVML_ERROR_LIBRARY_NOT_FOUND: GpuLibraryNotFoundError,
    NVML_ERROR_DRIVER_NOT_LOADED: GpuLibraryNotFoundError,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: GpuLibraryNotFoundError,
}

# Errors of nvmlInit that mean "no usable driver here" rather than a GPU problem.
_INIT_LIBRARY_ERRORS = frozenset(
    {
        NVML_ERROR_LIBRARY_NOT_FOUND,
        NVML_ERROR_FUNCTION_NOT_FOUND,
        NVML_ERROR_DRIVER_NOT_LOADED,
        NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

_HINTS: dict[type[GpuError], str] = {
    GpuNoPermissionError: (
        "changing clocks or power limits needs root (CAP_SYS_ADMIN) in the node agent's container"
    ),
    GpuLostError: "the GPU stopped responding; it needs a reset or a node reboot",
}

_LIBRARY_HINT = (
    f"Is the NVIDIA driver installed on this node? In a container, the driver's {NVML_LIBRARY} "
    "must be mounted from the host: run the pod with the NVIDIA container runtime "
    "(e.g. runtimeClassName: nvidia, NVIDIA_DRIVER_CAPABILITIES including 'utility'). "
    f"If the driver is installed in a non-standard place, add the directory holding "
    f"{NVML_LIBRARY} to LD_LIBRARY_PATH."
)


def _error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "value", None)
    return code if isinstance(code, int) else None


def _map_error(exc: BaseException, gpu_index: int | None, what: str) -> GpuError:
    """The project exception for an NVML error raised by ``what`` (on GPU ``gpu_index``)."""
    code = _error_code(exc)
    cls = _ERROR_CLASSES.get(code, GpuError) if code is not None else GpuError
    where = f"GPU {gpu_index}: " if gpu_index is not None else ""
    message = f"{where}{what} failed: {exc} (NVML error {code})"
    if code == NVML_ERROR_FUNCTION_NOT_FOUND:
        message += "; the installed NVIDIA driver is too old for this operation"
    elif cls is GpuLibraryNotFoundError:
        message += f". {_LIBRARY_HINT}"
    elif cls in _HINTS:
        message += f"; {_HINTS[cls]}"
    return cls(message, gpu_index=gpu_index)


def _dlopen_error() -> str:
    """Why the dynamic loader refuses NVML (the bindings swallow this)."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError as exc:
        return str(exc)
    return f"{NVML_LIBRARY} loads, but NVML could not be initialized"


def _import_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise GpuLibraryNotFoundError(
            "the NVML Python bindings are missing: install nvidia-ml-py "
            "(pip install 'perseus-k8s[agent]')"
        ) from exc


@dataclass
class _PowerIntegral:
    """Energy of one GPU integrated from power samples (trapezoids between samples)."""

    energy_j: float = 0.0
    last_time_s: float | None = None
    last_power_w: float = 0.0

    def add_sample(self, time_s: float, power_w: float) -> float:
        if self.last_time_s is not None:
            self.energy_j += (self.last_power_w + power_w) / 2.0 * (time_s - self.last_time_s)
        self.last_time_s = time_s
        self.last_power_w = power_w
        return self.energy_j


class NvmlBackend(GpuBackend):
    """GPUs of this node through NVML.

    Creating one initializes NVML; :meth:`close` (or leaving a ``with`` block) shuts it down.
    Thread-safe: the agent's HTTP handlers and its metrics loop may share one backend.

    Energy: on GPUs with a hardware energy counter (Volta and newer),
    ``nvmlDeviceGetTotalEnergyConsumption`` is read. Where that is not supported, energy is
    integrated from power samples taken at each ``energy_j`` and ``power_w`` call (trapezoid
    rule between consecutive samples), so its accuracy depends on how often they are called:
    power changes between two samples are seen only as a straight line between them.
    """

    def __init__(self) -> None:
        self._nvml = _import_pynvml()
        self._lock = threading.RLock()
        self._closed = False
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            code = _error_code(exc)
            if code in _INIT_LIBRARY_ERRORS:
                reason = _dlopen_error() if code == NVML_ERROR_LIBRARY_NOT_FOUND else str(exc)
                raise GpuLibraryNotFoundError(
                    f"NVML cannot be used: {reason} (NVML error {code}). {_LIBRARY_HINT}"
                ) from exc
            raise _map_error(exc, None, "nvmlInit") from exc
        self._handles: dict[int, Any] = {}
        self._supported_sm_clocks_mhz: dict[int, tuple[int, ...]] = {}
        # What this backend locked, per GPU index (the no-op checks of the setters).
        self._locked_sm_mhz: dict[int, int] = {}
        self._locked_memory_mhz: dict[int, int] = {}
        # GPUs without an energy counter, and their integrated energy.
        self._power_integrals: dict[int, _PowerIntegral] = {}
        self._power_limit_ranges: dict[int, PowerLimitRange] = {}

    # -- plumbing ---------------------------------------------------------------------------

    def _call(self, gpu_index: int | None, name: str, *args: Any) -> Any:
        """Call ``pynvml.<name>(*args)``, mapping NVML errors to the project's."""
        self._check_open()
        function: Callable[..., Any] = getattr(self._nvml, name)
        try:
            return function(*args)
        except self._nvml.NVMLError as exc:
            raise _map_error(exc, gpu_index, name) from exc

    def _check_open(self) -> None:
        if self._closed:
            raise GpuError("the NVML backend is closed")

    def _handle(self, index: int) -> Any:
        handle = self._handles.get(index)
        if handle is not None:
            return handle
        if index < 0:
            raise GpuNotFoundError(f"no GPU with index {index}", gpu_index=index)
        try:
            handle = self._call(index, "nvmlDeviceGetHandleByIndex", index)
        except GpuInvalidArgumentError as exc:
            # NVML's answer to an index past the last GPU.
            raise GpuNotFoundError(
                f"no GPU with index {index} (this node has {self._device_count()})",
                gpu_index=index,
            ) from exc
        self._handles[index] = handle
        return handle

    def _device_count(self) -> int:
        return int(self._call(None, "nvmlDeviceGetCount"))

    def _read_power_w(self, index: int) -> float:
        return int(self._call(index, "nvmlDeviceGetPowerUsage", self._handle(index))) / 1000.0

    # -- queries ----------------------------------------------------------------------------

    def devices(self) -> list[GpuInfo]:
        with self._lock:
            result = []
            for index in range(self._device_count()):
                handle = self._handle(index)
                uuid = str(self._call(index, "nvmlDeviceGetUUID", handle))
                name = str(self._call(index, "nvmlDeviceGetName", handle))
                result.append(GpuInfo(index=index, uuid=uuid, name=name))
            return result

    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        with self._lock:
            cached = self._supported_sm_clocks_mhz.get(index)
            if cached is None:
                handle = self._handle(index)
                memory_mhz = self._call(index, "nvmlDeviceGetSupportedMemoryClocks", handle)
                if not memory_mhz:
                    raise GpuNotSupportedError(
                        f"GPU {index}: NVML lists no supported memory clocks", gpu_index=index
                    )
                # Locked SM clocks are applied at the default (highest) memory clock; the
                # clocks supported at lower memory clocks are a different, smaller set.
                clocks = self._call(
                    index,
                    "nvmlDeviceGetSupportedGraphicsClocks",
                    handle,
                    max(int(mhz) for mhz in memory_mhz),
                )
                # NVML documents no order (and may repeat entries): sort once, here.
                cached = tuple(sorted({int(mhz) for mhz in clocks}, reverse=True))
                if not cached:
                    raise GpuNotSupportedError(
                        f"GPU {index}: NVML lists no supported SM clocks", gpu_index=index
                    )
                self._supported_sm_clocks_mhz[index] = cached
            return list(cached)

    def sm_clock_mhz(self, index: int) -> int:
        with self._lock:
            return int(
                self._call(index, "nvmlDeviceGetClockInfo", self._handle(index), NVML_CLOCK_SM)
            )

    def power_w(self, index: int) -> float:
        with self._lock:
            power_w = self._read_power_w(index)
            integral = self._power_integrals.get(index)
            if integral is not None:
                # Without an energy counter every power sample sharpens the integral.
                integral.add_sample(time.monotonic(), power_w)
            return power_w

    def energy_j(self, index: int) -> float:
        with self._lock:
            integral = self._power_integrals.get(index)
            if integral is None:
                try:
                    energy_mj = self._call(
                        index, "nvmlDeviceGetTotalEnergyConsumption", self._handle(index)
                    )
                except GpuNotSupportedError:
                    # No counter on this GPU (or driver): integrate power from now on. The
                    # origin is this first sample, which the ABC allows (arbitrary origin).
                    logger.info("GPU %d has no energy counter; integrating power samples", index)
                    integral = self._power_integrals[index] = _PowerIntegral()
                else:
                    return int(energy_mj) / 1000.0
            return integral.add_sample(time.monotonic(), self._read_power_w(index))

    def clock_event_reasons(self, index: int) -> int:
        with self._lock:
            handle = self._handle(index)
            try:
                return int(self._call(index, "nvmlDeviceGetCurrentClocksEventReasons", handle))
            except GpuNotSupportedError:
                # Drivers before r535 know the same bit mask by its older name only.
                return int(self._call(index, "nvmlDeviceGetCurrentClocksThrottleReasons", handle))

    def application_sm_clocks_mhz(self, index: int) -> tuple[int, int]:
        with self._lock:
            handle = self._handle(index)
            target = self._call(
                index, "nvmlDeviceGetClock", handle, NVML_CLOCK_SM, NVML_CLOCK_ID_APP_CLOCK_TARGET
            )
            default = self._call(
                index, "nvmlDeviceGetClock", handle, NVML_CLOCK_SM, NVML_CLOCK_ID_APP_CLOCK_DEFAULT
            )
            return int(target), int(default)

    # -- clock control ----------------------------------------------------------------------

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        with self._lock:
            if self._locked_sm_mhz.get(index) == clock_mhz:
                return False
            _check_clock(index, clock_mhz)
            # min = max: a range would let the GPU's boost logic pick the clock again.
            self._call(
                index, "nvmlDeviceSetGpuLockedClocks", self._handle(index), clock_mhz, clock_mhz
            )
            self._locked_sm_mhz[index] = clock_mhz
            return True

    def reset_sm_clock(self, index: int) -> bool:
        with self._lock:
            if index not in self._locked_sm_mhz:
                return False
            self._call(index, "nvmlDeviceResetGpuLockedClocks", self._handle(index))
            del self._locked_sm_mhz[index]
            return True

    def lock_memory_clock(self, index: int, clock_mhz: int) -> bool:
        with self._lock:
            if self._locked_memory_mhz.get(index) == clock_mhz:
                return False
            _check_clock(index, clock_mhz)
            self._call(
                index,
                "nvmlDeviceSetMemoryLockedClocks",
                self._handle(index),
                clock_mhz,
                clock_mhz,
            )
            self._locked_memory_mhz[index] = clock_mhz
            return True

    def reset_memory_clock(self, index: int) -> bool:
        with self._lock:
            if index not in self._locked_memory_mhz:
                return False
            self._call(index, "nvmlDeviceResetMemoryLockedClocks", self._handle(index))
            del self._locked_memory_mhz[index]
            return True

    def force_reset_clocks(self, index: int) -> None:
        """Reset the SM and memory clocks of GPU ``index``, whoever locked them.

        Unlike the ``reset_*`` methods this always calls NVML: it is for locks this backend
        cannot know about, e.g. those of a previous agent that was killed (NVML keeps locked
        clocks after the process that set them is gone). Both resets are attempted; the first
        error is raised afterwards.
        """
        with self._lock:
            handle = self._handle(index)
            errors: list[GpuError] = []
            for name, locked in (
                ("nvmlDeviceResetGpuLockedClocks", self._locked_sm_mhz),
                ("nvmlDeviceResetMemoryLockedClocks", self._locked_memory_mhz),
            ):
                try:
                    self._call(index, name, handle)
                except GpuNotSupportedError:
                    # A GPU that cannot lock this clock has no lock to undo.
                    locked.pop(index, None)
                except GpuError as exc:
                    errors.append(exc)
                else:
                    locked.pop(index, None)
            if errors:
                raise errors[0]

    # -- power limits (NVML's unit: milliwatts) ---------------------------------------------

    def power_limit_w(self, index: int) -> float:
        with self._lock:
            handle = self._handle(index)
            return int(self._call(index, "nvmlDeviceGetPowerManagementLimit", handle)) / 1000.0

    def power_limit_range_w(self, index: int) -> PowerLimitRange:
        with self._lock:
            cached = self._power_limit_ranges.get(index)
            if cached is None:
                handle = self._handle(index)
                min_mw, max_mw = self._call(
                    index, "nvmlDeviceGetPowerManagementLimitConstraints", handle
                )
                default_mw = self._call(index, "nvmlDeviceGetPowerManagementDefaultLimit", handle)
                cached = PowerLimitRange(
                    int(min_mw) / 1000.0, int(max_mw) / 1000.0, int(default_mw) / 1000.0
                )
                self._power_limit_ranges[index] = cached
            return cached

    def set_power_limit(self, index: int, limit_w: float) -> bool:
        with self._lock:
            check_power_limit(index, limit_w, self.power_limit_range_w(index))
            limit_mw = round(limit_w * 1000.0)
            handle = self._handle(index)
            if int(self._call(index, "nvmlDeviceGetPowerManagementLimit", handle)) == limit_mw:
                return False
            self._call(index, "nvmlDeviceSetPowerManagementLimit", handle, limit_mw)
            return True

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Shut NVML down (once; later calls do nothing). Clock locks stay as they are."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                # Nothing to do about it while closing; the process keeps running.
                logger.warning("nvmlShutdown failed: %s", _map_error(exc, None, "nvmlShutdown"))

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _check_clock(index: int, clock_mhz: int) -> None:
    # NVML takes unsigned ints: a negative clock would wrap around to a huge one.
    if clock_mhz <= 0:
        raise GpuInvalidArgumentError(
            f"GPU {index}: clock must be a positive number of MHz, got {clock_mhz}",
            gpu_index=index,
        )
