"""A computed frontier, kept compactly, and the all-max-frequency baseline.

A frontier can have tens of thousands of points, each assigning a duration to
thousands of computations. Storing every assignment would take gigabytes, so
the frontier keeps the starting assignment and the few computations each step
changed, and replays them to recover any point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_planner import _costs
from perseus_planner.solver import FrontierPoint, FrontierProblem, frontier_point, iterate_steps

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Frontier:
    """Iteration time–energy frontier of one pipeline, slowest point first.

    Attributes:
        problem: What was solved.
        quant_times: Iteration time of each point, in unit times (strictly decreasing).
        times_s: Iteration time of each point, seconds.
        energies_j: Energy of one iteration of the pipeline, blocking energy included.
        costs_j: Effective computation energy of each point (blocking excluded).
    """

    problem: FrontierProblem
    quant_times: IntArray
    times_s: FloatArray
    energies_j: FloatArray
    costs_j: FloatArray
    _start: IntArray
    _up_ptr: IntArray
    _up: IntArray
    _down_ptr: IntArray
    _down: IntArray

    def __len__(self) -> int:
        return len(self.quant_times)

    @property
    def t_min_index(self) -> int:
        """The fastest point (the end of the frontier)."""
        return len(self) - 1

    @property
    def t_star_index(self) -> int:
        """The minimum-energy point ``T*`` (the slowest one on ties)."""
        return int(np.argmin(self.energies_j))

    def durations_at(self, index: int) -> IntArray:
        """Duration (unit times) of every computation at point ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"frontier point {index} out of range 0..{len(self) - 1}")
        durations = self._start.copy()
        ups = self._up[: self._up_ptr[index + 1]]
        downs = self._down[: self._down_ptr[index + 1]]
        np.subtract.at(durations, ups, 1)
        np.add.at(durations, downs, 1)
        return durations

    def frequencies_at(self, index: int) -> IntArray:
        """Clock (MHz) of every computation at point ``index``."""
        return self.problem.frequencies_mhz(self.durations_at(index))


def compute_frontier(
    problem: FrontierProblem, on_point: Callable[[FrontierPoint], None] | None = None
) -> Frontier:
    """Run the solver to the end and keep the frontier.

    Args:
        problem: The prepared problem.
        on_point: Called with every point as it is found (progress reporting).
    """
    quant: list[int] = []
    costs: list[float] = []
    ups: list[IntArray] = []
    downs: list[IntArray] = []
    start: IntArray | None = None
    n = problem.dag.num_nodes
    for step in iterate_steps(problem, totals=on_point is not None):
        if start is None:
            start = step.durations[:n].copy()
        quant.append(step.quant_time)
        costs.append(step.cost_j)
        ups.append(step.sped_up)
        downs.append(step.slowed_down)
        if on_point is not None:
            on_point(frontier_point(problem, step.iteration, step.quant_time, step.cost_j,
                            step.durations[:n], step.sped_up, step.slowed_down))  # fmt: skip
    assert start is not None  # the solver always yields the starting point

    def offsets(parts: list[IntArray]) -> IntArray:
        ptr = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in parts], out=ptr[1:])
        return ptr

    quant_times = np.asarray(quant, dtype=np.int64)
    up_ptr, down_ptr = offsets(ups), offsets(downs)
    all_up, all_down = np.concatenate(ups), np.concatenate(downs)
    costs_j = np.asarray(costs, dtype=np.float64)
    if on_point is None:  # the steps left the totals to this
        tables = problem._tables
        durations = tables.dmax.copy()
        durations[:n] = start
        durations[n:] = 0
        _costs.point_costs(durations, up_ptr, all_up, down_ptr, all_down, tables.dummy,
                           tables.dmin, tables.tab_off, tables.cost_tab, costs_j)  # fmt: skip
        costs = costs_j.tolist()
    times_s = np.asarray(quant_times * problem.unit_time_s, dtype=np.float64)  # as each point
    return Frontier(
        problem=problem,
        quant_times=quant_times,
        times_s=times_s,
        energies_j=np.asarray(
            [problem.energy_j(c, t) for c, t in zip(costs, times_s.tolist(), strict=True)],
            dtype=np.float64,
        ),
        costs_j=costs_j,
        _start=start,
        _up_ptr=up_ptr,
        _up=all_up,
        _down_ptr=down_ptr,
        _down=all_down,
    )


@dataclass(frozen=True)
class Baseline:
    """Every GPU at its highest clock: what a job runs at without Perseus.

    Attributes:
        time_s: Its own iteration time, from the measured (unquantized) times.
        busy_time_s: Sum of the computation times over all GPUs of the pipeline.
        busy_energy_j: Sum of the measured computation energies.
        num_stages: GPUs (stages) in the pipeline.
        blocking_power_w: Power of one GPU while it waits.
    """

    time_s: float
    busy_time_s: float
    busy_energy_j: float
    num_stages: int
    blocking_power_w: float

    def energy_j(self, time_s: float | None = None) -> float:
        """Energy of one iteration that lasts ``time_s`` (default: its own time).

        Savings are compared at the same iteration time, as the Perseus paper
        does: every GPU draws blocking power for the rest of the iteration.
        """
        t = self.time_s if time_s is None else time_s
        idle_s = self.num_stages * t - self.busy_time_s
        return self.busy_energy_j + self.blocking_power_w * idle_s

    def savings_ratio(self, energy_j: float, time_s: float) -> float:
        """Fraction of energy saved by a plan of ``energy_j`` at iteration time ``time_s``."""
        return 1.0 - energy_j / self.energy_j(time_s)


def max_frequency_baseline(problem: FrontierProblem) -> Baseline:
    """Iteration time and energy of one pipeline with every GPU at its highest clock."""
    dag = problem.dag
    times = np.empty(dag.num_nodes, dtype=np.float64)
    energies = np.empty(dag.num_nodes, dtype=np.float64)
    for i, comp in enumerate(dag.computations):
        m = problem.profile.get(comp.stage, comp.instruction)
        fastest = int(np.argmax(m.frequencies_mhz))
        times[i] = m.times_s[fastest]
        energies[i] = m.energies_j[fastest]
    return Baseline(
        time_s=problem.real_makespan_s(times),
        busy_time_s=float(times.sum()),
        busy_energy_j=float(energies.sum()),
        num_stages=dag.num_stages,
        blocking_power_w=problem.blocking_power_w,
    )
