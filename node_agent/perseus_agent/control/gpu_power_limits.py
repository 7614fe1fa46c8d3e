"""Sets and restores the power limits a plan gives its GPUs (a power budget's hard backstop).

The power-limit counterpart of :mod:`perseus_agent.control.gpu_clocks`, restored exactly as a
clock is reset: the limit in force is recorded in the
:class:`~perseus_agent.clocks.reset_state.ResetState` *before* the first change (so a killed
agent's limits are put back when it restarts), and put back when the GPU leaves the plan, the
plan goes, or the agent stops.

A limit outside what the GPU accepts is clamped to its range (the backend refuses it; a budget's
share below a GPU's minimum is still best served by the minimum) and the report says so. A limit
that cannot be set (another owner's limit under ``--foreign-clocks=leave``, a GPU error) is
reported in the GPU's ``powerLimitMessage`` and counted in
``perseus_agent_apply_errors_total{reason}``; the GPU's clock plan goes on regardless.
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

__all__ = ["GpuPowerLimits"]

log = logging.getLogger(__name__)


class GpuPowerLimits:
    """The power limits of ``devices`` (on ``backend``) that this applier set.

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
        self._set: dict[int, float] = {}  # index -> limit this applier set (watts)
        self._fail_log = RateLimitedLog(log)

    def limited(self) -> set[int]:
        """Indices of the GPUs whose power limit this applier set and has not restored."""
        return set(self._set)

    def apply(self, g: GpuState, limit_w: float | None) -> None:
        """Give ``g`` the plan's power limit ``limit_w`` (clamped), or its original one back
        (``None``); ``g``'s report fields say what was done."""
        index = g.info.index
        g.power_limit_w, g.power_limit_message = None, ""
        if limit_w is None:
            self.restore(index)
            return
        try:
            allowed = self._backend.power_limit_range_w(index)
            applied_w = allowed.clamp_w(limit_w)
            if not self._reset_state.is_recorded(g.info, "power_limit"):
                original_w = self._backend.power_limit_w(index)
                self._reset_state.record(g.info, "power_limit", original_power_limit_w=original_w)
            self._backend.set_power_limit(index, applied_w)
        except GpuError as exc:
            self._fail(g, exc.reason, str(exc))
            return
        except OSError as exc:
            self._fail(g, "reset_state", f"cannot record the GPU before limiting it: {exc}")
            return
        self._set[index] = applied_w
        g.power_limit_w = applied_w
        if applied_w != limit_w:
            g.power_limit_message = (
                f"power limit {limit_w:g} W is outside what GPU {index} accepts "
                f"({allowed.min_w:g}..{allowed.max_w:g} W); clamped to {applied_w:g} W"
            )
            self._fail_log.log(logging.WARNING, ("clamped", index), "GPU %d: %s", index,
                               g.power_limit_message)  # fmt: skip

    def _fail(self, g: GpuState, reason: str, message: str) -> None:
        index = g.info.index
        self._fail_log.log(logging.ERROR, (reason, index), "GPU %d (%s): power limit: %s", index,
                           g.info.uuid, message)  # fmt: skip
        self._metrics.count_error(reason)
        g.power_limit_message = f"{reason}: {message}"
        # Do not leave the GPU at the limit of an older plan.
        self.restore(index)

    def restore(self, index: int) -> bool:
        """Put back the limit GPU ``index`` had before this agent first set one, if it set one;
        ``False`` if that failed (the GPU stays recorded: the next start retries)."""
        gpu = self._by_index[index]
        if index not in self._set and not self._reset_state.is_recorded(gpu, "power_limit"):
            return True
        original_w = self._reset_state.original_power_limit_w(gpu)
        try:
            if original_w is None:
                self._backend.reset_power_limit(index)
            elif round(self._backend.power_limit_w(index) * 1000) != round(original_w * 1000):
                # Only when changed: a GPU recorded but never set (another owner's limit was
                # in the way) is left to its owner.
                self._backend.set_power_limit(index, original_w)
        except GpuError as exc:
            log.error("cannot restore the power limit of GPU %d (%s): %s", index, gpu.uuid, exc)
            self._metrics.count_error(exc.reason)
            return False
        self._set.pop(index, None)
        self._reset_state.forget(gpu, "power_limit")
        return True
