"""Locks and resets the SM clocks of the plan's GPUs, and records what each one got.

The one part of the applier that changes a clock. Every GPU is recorded in the
:class:`~perseus_agent.clocks.reset_state.ResetState` before its clock is first locked, so a killed
agent's locks are undone when it restarts. A clock the GPU does not support is clamped to the
nearest supported one (asked once per GPU and clock, then remembered) and reported as
``Clamped``. A GPU error fails that GPU only: it is reported ``Failed`` with the error's reason,
counted in ``perseus_agent_apply_errors_total{reason}``, and its clock is reset.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.plan_state import GpuState
from perseus_agent.errors import GpuError
from perseus_agent.exporter import AgentMetrics
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_agent.log_limit import RateLimitedLog
from perseus_api.node_report import GpuStatus

__all__ = ["GpuClocks", "wait"]

log = logging.getLogger(__name__)


class GpuClocks:
    """The SM clocks of ``devices`` (on ``backend``) that this applier locked.

    Not thread-safe: the applier calls it under its lock.
    """

    def __init__(
        self,
        backend: GpuBackend,
        reset_state: ResetState,
        metrics: AgentMetrics,
        devices: Sequence[GpuInfo],
    ) -> None:
        self._backend = backend
        self._reset_state = reset_state
        self._metrics = metrics
        self._by_index = {g.index: g for g in devices}
        self._locked: dict[int, int] = {}  # index -> SM clock this agent locked
        self._nearest: dict[tuple[int, int], int] = {}  # (index, planned) -> supported clock
        # Instruction granularity retries a failed GPU every iteration (a GPU whose clocks
        # another owner holds fails every time).
        self._fail_log = RateLimitedLog(log)

    def locked(self) -> set[int]:
        """Indices of the GPUs this applier locked and has not reset."""
        return set(self._locked)

    def locked_gpus(self) -> list[int]:
        """Indices of the GPUs locked and not reset, by this applier or, as the reset record
        says, by an earlier agent."""
        recorded = {e.index for e in self._reset_state.entries()}
        return sorted(set(self._locked) | recorded)

    def nearest_clock(self, index: int, clock_mhz: int) -> int:
        key = (index, clock_mhz)
        nearest = self._nearest.get(key)
        if nearest is None:
            nearest = self._backend.nearest_supported_sm_clock_mhz(index, clock_mhz)
            self._nearest[key] = nearest
        return nearest

    def _lock_clock(self, gpu: GpuInfo, clock_mhz: int) -> None:
        """Record (first), then lock. Raises GpuError, or OSError if the record fails."""
        self._reset_state.record(gpu, "sm")
        changed = self._backend.lock_sm_clock(gpu.index, clock_mhz)
        self._locked[gpu.index] = clock_mhz
        if changed:
            self._metrics.count_clock_change(gpu.index)

    def set_clock(self, g: GpuState, target_mhz: int) -> None:
        """Lock ``g`` at ``target_mhz`` (clamped) and update its status; errors fail ``g``."""
        try:
            applied = self.nearest_clock(g.info.index, target_mhz)
            self._lock_clock(g.info, applied)
        except GpuError as exc:
            self.fail(g, exc.reason, str(exc), target_mhz)
            return
        except OSError as exc:
            self.fail(g, "reset_state", f"cannot record the GPU before locking it: {exc}", None)
            return
        g.target_mhz, g.applied_mhz = target_mhz, applied
        if applied == target_mhz:
            g.status, g.message = GpuStatus.APPLIED, ""
        else:
            g.status = GpuStatus.CLAMPED
            g.message = (
                f"{target_mhz} MHz is not supported by GPU {g.info.index}; clamped to {applied} MHz"
            )

    def lock_stage(self, g: GpuState) -> None:
        """Stage granularity: lock ``g`` at its stage's clock."""
        self.set_clock(g, g.stage_plan.frequency_mhz)
        if g.status == GpuStatus.CLAMPED:
            log.warning("GPU %d: %s", g.info.index, g.message)

    def fail(self, g: GpuState, reason: str, message: str, target_mhz: int | None) -> None:
        self._fail_log.log(
            logging.ERROR,
            (reason, g.info.index),
            "GPU %d (%s): %s",
            g.info.index,
            g.info.uuid,
            message,
        )
        self._metrics.count_error(reason)
        g.stop_sampling()
        g.status = GpuStatus.FAILED
        g.message = f"{reason}: {message}"
        g.target_mhz = target_mhz
        g.applied_mhz = None
        # Do not leave the GPU at a clock of an older plan.
        self.reset_clock(g.info.index)

    def reset_clock(self, index: int) -> bool:
        """Undo this agent's lock on GPU ``index``, if any; ``False`` if the reset failed."""
        gpu = self._by_index[index]
        if index not in self._locked and not self._reset_state.is_recorded(gpu, "sm"):
            return True
        try:
            changed = self._backend.reset_sm_clock(index)
        except GpuError as exc:
            log.error("cannot reset the SM clock of GPU %d (%s): %s", index, gpu.uuid, exc)
            self._metrics.count_error(exc.reason)
            return False  # stays recorded: the next start retries
        self._locked.pop(index, None)
        if changed:
            self._metrics.count_clock_change(index)
        self._reset_state.forget(gpu, "sm")
        return True


def wait(g: GpuState, message: str) -> None:
    """``g`` waits for its training process: no clock, back to the start of the schedule."""
    g.status, g.message = GpuStatus.WAITING, message
    g.target_mhz = g.applied_mhz = None
    g.position = 0
