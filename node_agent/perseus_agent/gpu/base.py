"""The GPU interface the agent works against (NVML in production, emulated in tests).

Units are in the names. Every method raises a subclass of
:class:`perseus_agent.errors.GpuError` on failure, never a library exception.
Setters do nothing (and return ``False``) when the GPU is already in the
requested state, so callers may re-apply a plan freely.

Power limits (the GPU's power management limit, ``nvidia-smi -pl``): the setter refuses a limit
outside the GPU's constraints with :class:`~perseus_agent.errors.GpuInvalidArgumentError` naming
the range; clamping is the caller's decision (the agent clamps and reports it). Backends without
power limits raise :class:`~perseus_agent.errors.GpuNotSupportedError` from every power-limit
method (the default here).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Final

from perseus_agent.errors import GpuInvalidArgumentError, GpuNotSupportedError

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
class PowerLimitRange:
    """What a GPU's power limit may be set to, and its default, in watts."""

    min_w: float
    max_w: float
    default_w: float

    def clamp_w(self, limit_w: float) -> float:
        """``limit_w`` brought within ``[min_w, max_w]``."""
        return min(self.max_w, max(self.min_w, limit_w))


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

    # -- power limits (optional: the defaults say the backend has none) ----------------------

    def power_limit_w(self, index: int) -> float:
        """The power management limit in force.

        Raises:
            GpuNotSupportedError: the backend or GPU has no power limit.
        """
        raise _no_power_limits(index)

    def power_limit_range_w(self, index: int) -> PowerLimitRange:
        """The limits the GPU accepts (min, max) and its default.

        Raises:
            GpuNotSupportedError: the backend or GPU has no power limit.
        """
        raise _no_power_limits(index)

    def set_power_limit(self, index: int, limit_w: float) -> bool:
        """Set the power limit; ``False`` if it is in force already.

        Raises:
            GpuInvalidArgumentError: ``limit_w`` is outside :meth:`power_limit_range_w`.
            GpuNotSupportedError: the backend or GPU has no power limit.
        """
        raise _no_power_limits(index)

    def reset_power_limit(self, index: int) -> bool:
        """Put the GPU's default power limit back; ``False`` if it is in force already."""
        default_w = self.power_limit_range_w(index).default_w
        return self.set_power_limit(index, default_w)

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


def _no_power_limits(index: int) -> GpuNotSupportedError:
    return GpuNotSupportedError(f"GPU {index}: this backend has no power limits", gpu_index=index)


def check_power_limit(index: int, limit_w: float, allowed: PowerLimitRange) -> None:
    """Raise :class:`GpuInvalidArgumentError` unless ``limit_w`` is within ``allowed``."""
    if not allowed.min_w <= limit_w <= allowed.max_w:
        raise GpuInvalidArgumentError(
            f"GPU {index}: power limit {limit_w:g} W is outside what the GPU accepts "
            f"({allowed.min_w:g}..{allowed.max_w:g} W)",
            gpu_index=index,
        )
