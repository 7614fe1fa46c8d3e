"""Clocks the agent did not set: found at start, left alone unless configured otherwise.

An administrator may hold a GPU's clocks with ``nvidia-smi -lgc`` (locked clocks) or
``nvidia-smi -ac`` (application clocks). NVML has no getter for a locked-clock range, but it
says when user-defined clocks hold the clock: the clock event reason
``ApplicationsClocksSetting`` (also named ``UserDefinedClocks``, one bit for both kinds), and
the SM application clock in effect against the GPU's default. :func:`classify` turns those
readings into a :class:`ForeignClocks` (pure); :class:`ClockOwnerGuard` surveys every GPU once,
after the agent has reset what a previous run of its own left locked (so only other owners'
clocks remain), and then stands between the agent and the backend:

* ``leave`` (the default): a lock on such a GPU is refused with
  :class:`~perseus_agent.errors.GpuForeignClocksError` (the applier reports the GPU ``Failed``,
  reason ``foreign_clocks``) and no reset ever touches it.
* ``override``: Perseus locks it as any other GPU; releasing it puts the administrator's clock
  back (locked min = max at the SM clock seen at start; NVML cannot tell a range) instead of
  resetting to the driver's defaults. Application clocks are a separate setting that Perseus's
  locks and resets never change, so they need nothing put back.

Power limits likewise: a GPU whose power limit at start (after the agent's own leftovers are
restored) is not its default has an administrator's limit (``nvidia-smi -pl``): ``leave`` refuses
to set it (:class:`~perseus_agent.errors.GpuForeignPowerLimitError`, reason
``foreign_power_limit``); ``override`` sets it, and releasing puts the administrator's limit back
(the applier restores the limit it recorded before its first change, which is that one).

Limits: a lock NVML does not report at start (an idle GPU reports ``GpuIdle`` rather than
user-defined clocks on some drivers) is not seen; an agent killed while it overrides an
administrator's lock leaves that GPU reset by its successor, which knows only its own record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from perseus_agent.errors import (
    GpuError,
    GpuForeignClocksError,
    GpuForeignPowerLimitError,
    GpuNotSupportedError,
)
from perseus_agent.gpu.base import CLOCK_EVENT_REASONS, GpuBackend, GpuInfo, PowerLimitRange

__all__ = [
    "ClockOwnerGuard",
    "ForeignClockPolicy",
    "ForeignClocks",
    "ForeignPowerLimit",
    "classify",
    "foreign_power_limit",
]

log = logging.getLogger(__name__)

_USER_DEFINED = CLOCK_EVENT_REASONS["user_defined_clocks"]


class ForeignClockPolicy(StrEnum):
    """What the agent does with clocks another owner set (``--foreign-clocks``)."""

    LEAVE = "leave"
    OVERRIDE = "override"


@dataclass(frozen=True)
class ForeignClocks:
    """Clocks of one GPU that another owner set, as seen at start."""

    kind: str
    """``locked`` (``nvidia-smi -lgc``) or ``applications`` (``nvidia-smi -ac``)."""
    sm_clock_mhz: int
    """The SM clock then; what an overridden lock is put back to."""
    application_clock_mhz: int | None = None
    """The SM application clock in effect, for ``applications``."""

    def describe(self, index: int) -> str:
        if self.kind == "applications":
            what = f"application clocks are set (SM {self.application_clock_mhz} MHz)"
        else:
            what = f"clocks are locked by another owner (SM at {self.sm_clock_mhz} MHz)"
        return (
            f"GPU {index}: {what}, e.g. by an administrator's nvidia-smi; the agent leaves "
            "them alone. Remove that setting (nvidia-smi -rgc / -rac) or run the agent with "
            "--foreign-clocks=override (chart: agent.foreignClocks=override)"
        )


@dataclass(frozen=True)
class ForeignPowerLimit:
    """A power limit another owner set on one GPU, as seen at start."""

    limit_w: float
    default_w: float

    def describe(self, index: int) -> str:
        return (
            f"GPU {index}: its power limit is {self.limit_w:g} W, not its default "
            f"{self.default_w:g} W: set by another owner, e.g. an administrator's nvidia-smi -pl; "
            "the agent leaves it alone. Reset it (nvidia-smi -pl "
            f"{self.default_w:g}) or run the agent with --foreign-clocks=override (chart: "
            "agent.foreignClocks=override)"
        )


def foreign_power_limit(limit_w: float, allowed: PowerLimitRange) -> ForeignPowerLimit | None:
    """The power limit another owner set, from the limit in force and the GPU's range; ``None``
    when the default holds (NVML's milliwatts: equal to the milliwatt)."""
    if round(limit_w * 1000) == round(allowed.default_w * 1000):
        return None
    return ForeignPowerLimit(limit_w, allowed.default_w)


def classify(
    event_reasons: int, sm_clock_mhz: int, application_sm_clocks_mhz: tuple[int, int] | None
) -> ForeignClocks | None:
    """The clocks another owner set on a GPU the agent has not locked, from NVML's readings:
    its clock event reasons (bit mask), SM clock and ``(target, default)`` application clocks
    (``None`` where the GPU has none). ``None``: the driver's defaults hold."""
    if application_sm_clocks_mhz is not None:
        target_mhz, default_mhz = application_sm_clocks_mhz
        if target_mhz != default_mhz:
            return ForeignClocks("applications", sm_clock_mhz, target_mhz)
    if event_reasons & _USER_DEFINED:
        return ForeignClocks("locked", sm_clock_mhz)
    return None


class ClockOwnerGuard(GpuBackend):
    """``inner`` with the GPUs whose clocks another owner set kept out of the agent's way.

    Call :meth:`survey` once the agent's own leftover locks are reset; until then (and for
    GPUs the survey found nothing on) every call passes straight through. Thread-safe.
    """

    def __init__(
        self, inner: GpuBackend, policy: ForeignClockPolicy = ForeignClockPolicy.LEAVE
    ) -> None:
        self.inner = inner
        self.policy = ForeignClockPolicy(policy)
        self._lock = threading.Lock()
        self._foreign: dict[int, ForeignClocks] = {}
        self._overridden: set[int] = set()  # foreign GPUs Perseus has locked (override)
        self._foreign_power: dict[int, ForeignPowerLimit] = {}

    # -- the survey ----------------------------------------------------------------------------

    def survey(self, devices: Iterable[GpuInfo]) -> dict[int, ForeignClocks]:
        """Read every GPU and record the clocks another owner set; returns them by index.

        A GPU that cannot be read counts as having none (logged): refusing to manage it for
        a transient error would be worse than the rare lock missed.
        """
        found: dict[int, ForeignClocks] = {}
        for gpu in devices:
            try:
                reasons = self.inner.clock_event_reasons(gpu.index)
                sm_clock_mhz = self.inner.sm_clock_mhz(gpu.index)
                try:
                    applications: tuple[int, int] | None = self.inner.application_sm_clocks_mhz(
                        gpu.index
                    )
                except GpuNotSupportedError:
                    applications = None
            except GpuError as exc:
                log.warning(
                    "GPU %d (%s): cannot tell whether another owner set its clocks: %s",
                    gpu.index,
                    gpu.uuid,
                    exc,
                )
                continue
            clocks = classify(reasons, sm_clock_mhz, applications)
            if clocks is not None:
                found[gpu.index] = clocks
                log.warning(
                    "%s (policy %s)",
                    clocks.describe(gpu.index).split(";")[0],
                    self.policy,
                )
        power = self._survey_power_limits(devices)
        with self._lock:
            self._foreign = found
            self._foreign_power = power
            self._overridden.clear()
        return dict(found)

    def _survey_power_limits(self, devices: Iterable[GpuInfo]) -> dict[int, ForeignPowerLimit]:
        found: dict[int, ForeignPowerLimit] = {}
        for gpu in devices:
            try:
                limit = foreign_power_limit(
                    self.inner.power_limit_w(gpu.index), self.inner.power_limit_range_w(gpu.index)
                )
            except GpuNotSupportedError:
                continue  # no power limit to respect
            except GpuError as exc:
                log.warning("GPU %d (%s): cannot read its power limit: %s", gpu.index, gpu.uuid,
                            exc)  # fmt: skip
                continue
            if limit is not None:
                found[gpu.index] = limit
                log.warning("%s (policy %s)", limit.describe(gpu.index).split(";")[0], self.policy)
        return found

    def foreign_power_limits(self) -> dict[int, ForeignPowerLimit]:
        """The power limits other owners set, by GPU index (for the exporter and reports)."""
        with self._lock:
            return dict(self._foreign_power)

    def foreign(self) -> dict[int, ForeignClocks]:
        """The clocks other owners set, by GPU index (for the exporter)."""
        with self._lock:
            return dict(self._foreign)

    # -- clock control ---------------------------------------------------------------------

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        with self._lock:
            clocks = self._foreign.get(index)
            if clocks is not None and self.policy == ForeignClockPolicy.LEAVE:
                raise GpuForeignClocksError(clocks.describe(index), gpu_index=index)
            changed = self.inner.lock_sm_clock(index, clock_mhz)
            if clocks is not None:
                self._overridden.add(index)
            return changed

    def reset_sm_clock(self, index: int) -> bool:
        with self._lock:
            clocks = self._foreign.get(index)
            if clocks is None:
                return self.inner.reset_sm_clock(index)
            if index not in self._overridden:
                return False  # never Perseus's to reset
            if clocks.kind == "locked":
                # Put the administrator's lock back rather than the driver's defaults.
                self.inner.lock_sm_clock(index, clocks.sm_clock_mhz)
            else:
                self.inner.reset_sm_clock(index)
            self._overridden.discard(index)
            return True

    def set_power_limit(self, index: int, limit_w: float) -> bool:
        with self._lock:
            limit = self._foreign_power.get(index)
        if limit is not None and self.policy == ForeignClockPolicy.LEAVE:
            raise GpuForeignPowerLimitError(limit.describe(index), gpu_index=index)
        return self.inner.set_power_limit(index, limit_w)

    def force_reset_clocks(self, index: int) -> None:
        with self._lock:
            guarded = index in self._foreign
        if guarded:
            self.reset_sm_clock(index)
            self.inner.reset_memory_clock(index)
        else:
            self.inner.force_reset_clocks(index)

    # -- the rest passes through -----------------------------------------------------------

    def devices(self) -> list[GpuInfo]:
        return self.inner.devices()

    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        return self.inner.supported_sm_clocks_mhz(index)

    def sm_clock_mhz(self, index: int) -> int:
        return self.inner.sm_clock_mhz(index)

    def power_w(self, index: int) -> float:
        return self.inner.power_w(index)

    def energy_j(self, index: int) -> float:
        return self.inner.energy_j(index)

    def lock_memory_clock(self, index: int, clock_mhz: int) -> bool:
        return self.inner.lock_memory_clock(index, clock_mhz)

    def reset_memory_clock(self, index: int) -> bool:
        return self.inner.reset_memory_clock(index)

    def clock_event_reasons(self, index: int) -> int:
        return self.inner.clock_event_reasons(index)

    def application_sm_clocks_mhz(self, index: int) -> tuple[int, int]:
        return self.inner.application_sm_clocks_mhz(index)

    def nearest_supported_sm_clock_mhz(self, index: int, clock_mhz: int) -> int:
        return self.inner.nearest_supported_sm_clock_mhz(index, clock_mhz)

    def power_limit_w(self, index: int) -> float:
        return self.inner.power_limit_w(index)

    def power_limit_range_w(self, index: int) -> PowerLimitRange:
        return self.inner.power_limit_range_w(index)

    def close(self) -> None:
        self.inner.close()
