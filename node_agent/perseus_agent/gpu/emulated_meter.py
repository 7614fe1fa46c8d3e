"""What an emulated GPU's sensors read from its state: its SM clock, power and energy counter.

The clock is the one asked for (the locked one, else the highest), lowered under a power limit
for the computation the GPU runs: its highest profiled clock (not above the asked one) whose
power fits, as firmware capping does and ``perseus simulate --power-budget``'s uniform cap
assumes. Power is the profile's at that clock while the GPU computes, the blocking power while
it idles or waits. The energy counter integrates that piecewise-constant power exactly over
``clock()`` time: the backend (:mod:`perseus_agent.gpu.emulated`) banks the energy so far with
:meth:`GpuMeter.bank_energy` before every change of state (activity, clock lock, power limit).
"""

from __future__ import annotations

from collections.abc import Callable

from perseus_agent.gpu.emulated_profile import ProfileModel
from perseus_agent.gpu.emulated_state import GpuState

__all__ = ["GpuMeter"]


class GpuMeter:
    """Readings of one profile's emulated GPUs (it holds no GPU state).

    Args:
        model: The profile's times and powers by clock.
        blocking_power_w: Power of an idle or blocked GPU.
        clock: Time source in seconds of the energy counters.
    """

    def __init__(
        self, model: ProfileModel, blocking_power_w: float, clock: Callable[[], float]
    ) -> None:
        self._model = model
        self._blocking_power_w = blocking_power_w
        self._clock = clock

    def requested_clock_mhz(self, gpu: GpuState) -> int:
        locked = gpu.locked_sm_clock_mhz
        return self._model.max_clock_mhz if locked is None else locked

    def current_clock_mhz(self, gpu: GpuState) -> int:
        """The clock the GPU runs at: the requested one, lowered under a power limit for the
        computation it runs (idle, it draws the blocking power whatever the clock)."""
        requested = self.requested_clock_mhz(gpu)
        if gpu.power_limit_w is None or gpu.activity is None:
            return requested
        return self._model.capped_clock_mhz(gpu.activity, requested, gpu.power_limit_w)

    def power_w(self, gpu: GpuState) -> float:
        if gpu.activity is None:
            return self._blocking_power_w
        return self._model.power_w(gpu.activity, self.current_clock_mhz(gpu))

    def energy_j(self, gpu: GpuState) -> float:
        elapsed_s = max(0.0, self._clock() - gpu.last_change_s)
        return gpu.energy_j + self.power_w(gpu) * elapsed_s

    def bank_energy(self, gpu: GpuState) -> None:
        """Add the energy since the last change at the current power; call before a change."""
        now = self._clock()
        if now > gpu.last_change_s:
            gpu.energy_j += self.power_w(gpu) * (now - gpu.last_change_s)
            if gpu.activity is not None:
                gpu.busy_s += now - gpu.last_change_s
            gpu.last_change_s = now
