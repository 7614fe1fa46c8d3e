"""The GPU interface the agent works against (NVML in production, emulated in tests).

Units are in the names. Every method raises a subclass of
:class:`perseus_agent.errors.GpuError` on failure, never a library exception.
Setters do nothing (and return ``False``) when the GPU is already in the
requested state, so callers may re-apply a plan freely.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Final

from perseus_agent.errors import GpuNotSupportedError

CLOCK_EVENT_REASONS: Final[dict[str, int]] = {
    "gpu_idle": 0x1,
    # NVML's ApplicationsClocksSetting, also named UserDefinedClocks: application clocks
    # (nvidia-smi -ac) or locked clocks (nvidia-smi -lgc, Perseus's own locks) hold the clock.
    "user_defined_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
"""Clock event ("throttle") reasons by metric label, with their ``nvmlClocksEventReason*`` bit
(nvml.h; part of the library's ABI)."""


@dataclass(frozen=True)
class GpuInfo:
    """Identity of one GPU on this node."""

    index: int
    uuid: str
    name: str


class GpuBackend(ABC):
    """Read and control the SM clock of the GPUs of one node."""

    @abstractmethod
    def devices(self) -> list[GpuInfo]:
        """All GPUs, by index."""

    @abstractmethod
    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        """SM clocks the GPU can be locked to at its highest memory clock, descending."""

    @abstractmethod
    def sm_clock_mhz(self, index: int) -> int:
        """Current SM clock."""

    @abstractmethod
    def power_w(self, index: int) -> float:
        """Current power draw."""

    @abstractmethod
    def energy_j(self, index: int) -> float:
        """Energy consumed since an arbitrary fixed origin (monotonic counter)."""

    @abstractmethod
    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        """Lock the SM clock (min = max = ``clock_mhz``); ``False`` if already locked there."""

    @abstractmethod
    def reset_sm_clock(self, index: int) -> bool:
        """Undo any SM clock lock; ``False`` if none was set by this backend."""

    @abstractmethod
    def lock_memory_clock(self, index: int, clock_mhz: int) -> bool:
        """Lock the memory clock; ``False`` if already locked there."""

    @abstractmethod
    def reset_memory_clock(self, index: int) -> bool:
        """Undo any memory clock lock; ``False`` if none was set by this backend."""

    def clock_event_reasons(self, index: int) -> int:
        """Why the SM clock is what it is now: a bit mask of :data:`CLOCK_EVENT_REASONS`.

        Raises:
            GpuNotSupportedError: the backend or GPU cannot tell.
        """
        raise GpuNotSupportedError(
            f"GPU {index}: this backend reports no clock event reasons", gpu_index=index
        )

    def application_sm_clocks_mhz(self, index: int) -> tuple[int, int]:
        """The SM application clock in effect and the GPU's default one, ``(target, default)``.

        They differ when someone set application clocks (``nvidia-smi -ac``).

        Raises:
            GpuNotSupportedError: the backend or GPU has no application clocks.
        """
        raise GpuNotSupportedError(
            f"GPU {index}: this backend has no application clocks", gpu_index=index
        )

    def force_reset_clocks(self, index: int) -> None:
        """Reset SM and memory clock locks whoever set them.

        For start-up after a crash: the locks of a killed agent are unknown to a
        new backend instance, whose plain resets would skip them. Backends that
        track their own locks override this to reset unconditionally.
        """
        self.reset_sm_clock(index)
        self.reset_memory_clock(index)

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release the library; the backend is unusable afterwards."""

    def nearest_supported_sm_clock_mhz(self, index: int, clock_mhz: int) -> int:
        """The supported clock closest to ``clock_mhz`` (the higher one on a tie)."""
        clocks = self.supported_sm_clocks_mhz(index)
        return min(clocks, key=lambda c: (abs(c - clock_mhz), -c))
