"""An in-memory GPU backend for unit tests: records every call, fails on demand."""

from __future__ import annotations

from dataclasses import dataclass, field

from perseus_agent.errors import GpuError, GpuNotFoundError
from perseus_agent.gpu.base import GpuBackend, GpuInfo

# A100 SXM: 1410 MHz down to 210 MHz in 15 MHz steps.
A100_CLOCKS_MHZ: tuple[int, ...] = tuple(range(1410, 209, -15))
DEFAULT_MAX_MHZ = 1410


@dataclass
class FakeGpu:
    info: GpuInfo
    locked_sm_mhz: int | None = None
    locked_memory_mhz: int | None = None
    energy_j: float = 0.0
    power_w: float = 80.0


@dataclass
class FakeBackend(GpuBackend):
    """``num_gpus`` GPUs with UUIDs ``GPU-0``, ``GPU-1``, ...

    ``calls`` lists every call as ``(method, index, *args)``; ``fail[(method, index)]`` makes
    that call raise the given error (every time, until removed).
    """

    num_gpus: int = 4
    clocks_mhz: tuple[int, ...] = A100_CLOCKS_MHZ
    calls: list[tuple[object, ...]] = field(default_factory=list)
    fail: dict[tuple[str, int], GpuError] = field(default_factory=dict)
    gpus: list[FakeGpu] = field(init=False)

    def __post_init__(self) -> None:
        self.gpus = [
            FakeGpu(GpuInfo(index=i, uuid=f"GPU-{i}", name="Fake A100"), energy_j=1000.0 * i)
            for i in range(self.num_gpus)
        ]

    def _gpu(self, method: str, index: int, *args: object) -> FakeGpu:
        self.calls.append((method, index, *args))
        error = self.fail.get((method, index))
        if error is not None:
            raise error
        if not 0 <= index < len(self.gpus):
            raise GpuNotFoundError(f"no GPU {index}", gpu_index=index)
        return self.gpus[index]

    # -- test helpers ---------------------------------------------------------------------

    def mutating_calls(self) -> list[tuple[object, ...]]:
        return [c for c in self.calls if str(c[0]).startswith(("lock_", "reset_", "force_"))]

    def locked(self) -> dict[int, int]:
        """Index -> locked SM clock, of the GPUs that are locked."""
        return {g.info.index: g.locked_sm_mhz for g in self.gpus if g.locked_sm_mhz is not None}

    # -- GpuBackend ---------------------------------------------------------------------------

    def devices(self) -> list[GpuInfo]:
        self.calls.append(("devices",))
        return [g.info for g in self.gpus]

    def supported_sm_clocks_mhz(self, index: int) -> list[int]:
        self._gpu("supported_sm_clocks_mhz", index)
        return list(self.clocks_mhz)

    def sm_clock_mhz(self, index: int) -> int:
        gpu = self._gpu("sm_clock_mhz", index)
        return gpu.locked_sm_mhz if gpu.locked_sm_mhz is not None else self.clocks_mhz[0]

    def power_w(self, index: int) -> float:
        return self._gpu("power_w", index).power_w

    def energy_j(self, index: int) -> float:
        return self._gpu("energy_j", index).energy_j

    def lock_sm_clock(self, index: int, clock_mhz: int) -> bool:
        gpu = self._gpu("lock_sm_clock", index, clock_mhz)
        if gpu.locked_sm_mhz == clock_mhz:
            return False
        gpu.locked_sm_mhz = clock_mhz
        return True

    def reset_sm_clock(self, index: int) -> bool:
        gpu = self._gpu("reset_sm_clock", index)
        if gpu.locked_sm_mhz is None:
            return False
        gpu.locked_sm_mhz = None
        return True

    def lock_memory_clock(self, index: int, clock_mhz: int) -> bool:
        gpu = self._gpu("lock_memory_clock", index, clock_mhz)
        if gpu.locked_memory_mhz == clock_mhz:
            return False
        gpu.locked_memory_mhz = clock_mhz
        return True

    def reset_memory_clock(self, index: int) -> bool:
        gpu = self._gpu("reset_memory_clock", index)
        if gpu.locked_memory_mhz is None:
            return False
        gpu.locked_memory_mhz = None
        return True

    def force_reset_clocks(self, index: int) -> None:
        gpu = self._gpu("force_reset_clocks", index)
        gpu.locked_sm_mhz = None
        gpu.locked_memory_mhz = None
