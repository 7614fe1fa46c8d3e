"""A GPU backend the agent can let go of and take back (a GPU driver upgrade on the node).

:meth:`ReleasableBackend.release` closes the backend it wraps (for NVML: ``nvmlShutdown``, so
the driver can be unloaded); until :meth:`ReleasableBackend.reopen` opens a new one, every GPU
call raises :class:`~perseus_agent.errors.GpuReleasedError` and :meth:`devices` answers from the
list read first (the GPUs' indices and UUIDs outlive a driver upgrade). Calls are serialized
with release and reopen, so none runs on a backend being closed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from perseus_agent.errors import GpuReleasedError
from perseus_agent.gpu.base import GpuBackend, GpuInfo, PowerLimitRange

__all__ = ["ReleasableBackend"]

log = logging.getLogger(__name__)


class ReleasableBackend(GpuBackend):
    """``inner``, released and reopened (with ``reopen``) on request.

    Args:
        inner: The open backend.
        reopen: Opens a new backend (raises what opening raises, e.g. ``GpuError``).

    """

    def __init__(self, inner: GpuBackend, reopen: Callable[[], GpuBackend]) -> None:
        self._inner: GpuBackend | None = inner
        self._reopen = reopen
        self._lock = threading.RLock()
        self._devices: list[GpuInfo] | None = None  # as listed first

    @property
    def released(self) -> bool:
        with self._lock:
            return self._inner is None

    def release(self) -> None:
        """Close the backend (nothing if already released). Clock locks and power limits stay
        as they are: reset them first."""
        with self._lock:
            inner, self._inner = self._inner, None
            if inner is not None:
                inner.close()
                log.info("GPU library released")

    def reopen(self) -> None:
        """Open a new backend if released; its exceptions propagate (still released)."""
        with self._lock:
            if self._inner is not None:
                return
            inner = self._reopen()
            before = [(g.index, g.uuid) for g in self._devices or ()]
            found = [(g.index, g.uuid) for g in inner.devices()]
            if self._devices is not None and found != before:
                log.warning(
                    "the GPUs changed while the GPU library was released (%s, were %s); plans "
                    "name GPUs by UUID and index as listed at start",
                    found,
                    before,
                )
            self._inner = inner
            log.info("GPU library opened again")

    def _backend(self, index: int) -> GpuBackend:
        if self._inner is None:
            raise GpuReleasedError(
                f"GPU {index}: the agent released the GPU library while the node's GPU driver "
                "is upgraded; it takes the GPUs back when the upgrade is done",
                gpu_index=index,
            )
        return self._inner

    # -- GpuBackend ----------------------------------------------------------------------------

    def devices(self) -> list[GpuInfo]:
        """The GPUs as first listed (also while released, once listed)."""
        with self._lock:
            if self._devices is None:
                self._devices = self._backend(-1).devices()
            return list(self._devices)

    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        with self._lock:
            return self._backend(index).supported_sm_clocks_mhz(index)

    def sm_clock_mhz(self, index: int) -> int:
        with self._lock:
            return self._backend(index).sm_clock_mhz(index)

    def power_w(self, index: int) -> float:
        with self._lock:
            return self._backend(index).power_w(index)

    def energy_j(self, index: int) -> float:
        with self._lock:
            return self._backend(index).energy_j(index)

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        with self._lock:
            return self._backend(index).lock_sm_clock(index, clock_mhz)

    def reset_sm_clock(self, index: int) -> bool:
        with self._lock:
            return self._backend(index).reset_sm_clock(index)

    def lock_memory_clock(self, index: int, clock_mhz: int) -> bool:
        with self._lock:
            return self._backend(index).lock_memory_clock(index, clock_mhz)

    def reset_memory_clock(self, index: int) -> bool:
        with self._lock:
            return self._backend(index).reset_memory_clock(index)

    def force_reset_clocks(self, index: int) -> None:
        with self._lock:
            self._backend(index).force_reset_clocks(index)

    def clock_event_reasons(self, index: int) -> int:
        with self._lock:
            return self._backend(index).clock_event_reasons(index)

    def application_sm_clocks_mhz(self, index: int) -> tuple[int, int]:
        with self._lock:
            return self._backend(index).application_sm_clocks_mhz(index)

    def nearest_supported_sm_clock_mhz(self, index: int, clock_mhz: int) -> int:
        with self._lock:
            return self._backend(index).nearest_supported_sm_clock_mhz(index, clock_mhz)

    def power_limit_w(self, index: int) -> float:
        with self._lock:
            return self._backend(index).power_limit_w(index)

    def power_limit_range_w(self, index: int) -> PowerLimitRange:
        with self._lock:
            return self._backend(index).power_limit_range_w(index)

    def set_power_limit(self, index: int, limit_w: float) -> bool:
        with self._lock:
            return self._backend(index).set_power_limit(index, limit_w)

    def reset_power_limit(self, index: int) -> bool:
        with self._lock:
            return self._backend(index).reset_power_limit(index)

    def close(self) -> None:
        self.release()
