"""Profiling a GPU under a plan with ``profiling`` set (see
:mod:`perseus_agent.profiling.profiler`).

Each assigned GPU samples its energy counter in the background and, once its training process
calls in, runs the clocks of the profiling schedule one after the other (locked at
``step_begin``, clamped and reported like any other clock), measuring every forward and
backward from the process's requests. When the last clock is measured the GPU's clock is reset
(status ``Applied`` with no clock: nothing is locked any more) and the GPU's report
(:func:`profiling_report`) carries its profile rows and blocking power. A GPU error fails that
GPU's profiling only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from perseus_agent.control.gpu_clocks import GpuClocks, wait
from perseus_agent.control.plan_state import GpuState
from perseus_agent.errors import GpuError
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_agent.profiling.energy_sampler import EnergySampler
from perseus_agent.profiling.profiler import StageProfiler
from perseus_api.node_plan import ProfilingSpec
from perseus_api.node_report import GpuProfilingReport, GpuStatus

__all__ = ["GpuProfiling", "SamplerFactory", "profiling_report"]

log = logging.getLogger(__name__)

SamplerFactory = Callable[[GpuInfo, Callable[[], float]], EnergySampler]
"""Makes the energy sampler of a profiled GPU from the GPU and a reader of its counter."""


class GpuProfiling:
    """Runs the profiling of the plan's GPUs from their training processes' requests.

    Not thread-safe: the applier calls it under its lock.

    Args:
        backend: The GPUs of this node (their energy counters).
        clocks: Locks the clocks of the profiling schedule.
        sampler_factory: Makes the energy sampler of a profiled GPU (default: an
            :class:`~perseus_agent.profiling.energy_sampler.EnergySampler` sampling every 5 ms in a
            thread), started here and stopped once the GPU's profiling is over.
    """

    def __init__(
        self,
        backend: GpuBackend,
        clocks: GpuClocks,
        sampler_factory: SamplerFactory | None = None,
    ) -> None:
        self._backend = backend
        self._clocks = clocks
        self._sampler_factory = sampler_factory or _default_sampler

    def prepare(self, g: GpuState, old: GpuState | None, spec: ProfilingSpec) -> None:
        """Profiling: sample the energy counter from now on; lock nothing until the training
        process begins an iteration."""
        index = g.info.index
        sampler = self._sampler_factory(g.info, lambda: self._backend.energy_j(index))
        clocks = list(spec.frequencies_mhz)
        error: GpuError | None = None
        try:  # learn the supported clocks now, not on the training process's critical path
            clocks = _distinct_nearest(
                clocks, lambda clock: self._clocks.nearest_clock(index, clock)
            )
        except GpuError as exc:
            error = exc
        if len(clocks) < len(spec.frequencies_mhz):
            log.info(
                "GPU %d: profiling %d of %d scheduled clocks; the others are measured already "
                "at the same nearest supported clock",
                index,
                len(clocks),
                len(spec.frequencies_mhz),
            )
        g.profiler = StageProfiler(
            g.assignment.stage,
            clocks,
            num_stages=g.num_stages,
            virtual_stages=g.virtual_stages,
            iterations_per_frequency=spec.iterations_per_frequency,
            warmup_iterations=spec.warmup_iterations,
            sampler=sampler,
        )
        if old is not None:
            g.session = old.session
        if error is not None:
            self._clocks.fail(g, error.reason, str(error), None)
            return
        # No clock of an earlier plan may leak into the measurements.
        self._clocks.reset_clock(index)
        wait(g, "profiling: waiting for the training process to begin an iteration")
        sampler.start()

    def ok(self, g: GpuState) -> bool:
        """Whether ``g``'s profiling goes on; a failed energy counter fails the GPU."""
        if not g.profiling_active:
            return False
        assert g.profiler is not None
        error = g.profiler.sampler.error
        if error is None:
            return True
        reason = error.reason if isinstance(error, GpuError) else "profiling"
        self._clocks.fail(g, reason, f"cannot read the energy counter: {error}", g.target_mhz)
        return False

    def step_begin(self, g: GpuState, profiler: StageProfiler, t_ns: int) -> None:
        if not self.ok(g):
            return
        target = profiler.step_begin(t_ns)
        if target is None:
            self.poll(g)
            return
        if g.target_mhz != target or g.applied_mhz is None:
            self._clocks.set_clock(g, target)
            if g.status == GpuStatus.FAILED or g.applied_mhz is None:
                return
            if g.status == GpuStatus.CLAMPED:
                log.warning("GPU %d: profiling: %s", g.info.index, g.message)
            log.info(
                "GPU %d: profiling stage %d at %d MHz (clock %d of %d)",
                g.info.index,
                profiler.stage,
                g.applied_mhz,
                profiler.frequency_index + 1,
                len(profiler.frequencies_mhz),
            )
        assert g.applied_mhz is not None
        profiler.clock_applied(g.applied_mhz)

    def step_end(self, g: GpuState, profiler: StageProfiler, t_ns: int) -> None:
        if not self.ok(g):
            return
        if profiler.step_end(t_ns):
            self._finish_measuring(g)
        self.poll(g)

    def instruction_begin(
        self, g: GpuState, profiler: StageProfiler, name: str, t_ns: int, chunk: int | None
    ) -> None:
        if self.ok(g):
            # A counter point at each edge, not only every 5 ms: interpolated across an edge,
            # the counter put part of each computation's energy in the idle time beside it
            # (blocking power came out +11 %).
            profiler.sampler.sample()
            profiler.instruction_begin(name, t_ns, chunk)

    def instruction_end(
        self, g: GpuState, profiler: StageProfiler, name: str, t_ns: int, chunk: int | None
    ) -> None:
        if self.ok(g):
            profiler.sampler.sample()  # a point at the edge, as at its begin
            profiler.instruction_end(name, t_ns, chunk)

    def disconnected(self, g: GpuState, profiler: StageProfiler) -> None:
        """``g``'s training process is gone: an interrupted clock is measured again later."""
        self.poll(g)
        if profiler.measuring and g.status != GpuStatus.FAILED:
            profiler.interrupt()
            self._clocks.reset_clock(g.info.index)
            wait(g, "profiling: the training process disconnected")

    def _finish_measuring(self, g: GpuState) -> None:
        """The last clock is measured: back to the default clock."""
        assert g.profiler is not None
        # A point after the last iteration, so that it can be computed now unless the counter
        # has not been updated since (then at a later request or report).
        g.profiler.sampler.sample()
        reset = self._clocks.reset_clock(g.info.index)
        g.target_mhz = g.applied_mhz = None
        g.status = GpuStatus.APPLIED
        g.message = (
            "profiling: every clock measured; SM clock reset"
            if reset
            else "profiling: every clock measured; the SM clock could not be reset"
        )
        log.info("GPU %d: %s", g.info.index, g.message)

    def poll(self, g: GpuState) -> None:
        """Compute what the energy samples now allow; stop sampling once done."""
        p = g.profiler
        if p is None or g.status == GpuStatus.FAILED or g.profile_reported:
            return
        if not p.done:
            if not self.ok(g):
                return
            p.poll()
            if not p.done:
                return
        p.sampler.stop()
        g.profile_reported = True
        blocking = p.blocking_power_w
        log.info(
            "GPU %d (%s): profiling of stage %d done: %d iterations measured, %d dropped, "
            "blocking power %s; profile:\n%s",
            g.info.index,
            g.info.uuid,
            p.stage,
            p.measured_iterations,
            p.dropped_iterations,
            "unknown" if blocking is None else f"{blocking:.3f} W",
            p.to_csv().rstrip("\n"),
        )


def profiling_report(g: GpuState, p: StageProfiler) -> GpuProfilingReport:
    """The report of ``g``'s profiling so far (``p``: its profiler); rows once it is done."""
    done = p.done and g.status != GpuStatus.FAILED
    return GpuProfilingReport(
        uuid=g.info.uuid,
        index=g.info.index,
        stage=p.stage,
        rank=g.assignment.rank,
        frequencies_mhz=list(p.frequencies_mhz),
        applied_mhz=list(p.applied_mhz),
        frequency_index=p.frequency_index,
        measured_iterations=p.measured_iterations,
        dropped_iterations=p.dropped_iterations,
        done=done,
        rows=p.rows() if done else [],
        blocking_power_w=p.blocking_power_w if done else None,
        blocking_s=p.blocking_s if done else 0.0,
    )


def _default_sampler(gpu: GpuInfo, read_energy_j: Callable[[], float]) -> EnergySampler:
    return EnergySampler(read_energy_j, name=f"perseus-energy-gpu{gpu.index}")


def _distinct_nearest(clocks: Sequence[int], nearest: Callable[[int], int]) -> list[int]:
    """The scheduled clocks whose nearest supported clock differs from every earlier one's: a
    sweep wider than the GPU's range would otherwise measure its top clock again and again."""
    seen: set[int] = set()
    kept = []
    for clock in clocks:
        supported = nearest(clock)
        if supported not in seen:
            seen.add(supported)
            kept.append(clock)
    return kept
