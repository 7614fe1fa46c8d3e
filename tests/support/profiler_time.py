"""Simulated time for the profiler: integer nanoseconds, and an energy sampler sampled by hand
on it."""

from __future__ import annotations

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_agent.profiling.energy_sampler import EnergySampler

MS = 1_000_000


def ns(seconds: float) -> int:
    return round(seconds * 1e9)


class SimTime:
    """Simulated time: integer nanoseconds for the profiler, seconds for the emulated GPU."""

    def __init__(self) -> None:
        self.ns = 5_000 * 10**9

    def now_ns(self) -> int:
        return self.ns

    def now_s(self) -> float:
        return self.ns / 1e9


def manual_sampler(gpus: EmulatedBackend, sim: SimTime, index: int = 0) -> EnergySampler:
    return EnergySampler(lambda: gpus.energy_j(index), interval_s=None, time_ns=sim.now_ns)
