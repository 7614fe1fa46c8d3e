"""A cluster power budget met four ways, on a mix of jobs (``perseus simulate --power-budget``).

The budget is a fraction of the mix's all-max draw (every GPU of every job at its highest
clock). For each budget, from 100 % down to the lowest the allocation can meet:

- ``perseus``: each job's point on its menu chosen by :func:`perseus_planner.power.allocate`
  (least weighted slowdown within the budget);
- ``gpu-cap``: one power cap per GPU, budget / GPUs, on every GPU (what NVIDIA's power agent
  or a node-level capper does): each computation at the highest clock whose power fits;
- ``locked-clock``: one clock for every GPU (its own highest if lower), the highest whose
  total draw fits;
- ``job-cap``: each job its share of the budget in proportion to its all-max draw, spread as
  one cap over its GPUs.

Throughput kept: ``sum_j w_j T_allmax_j / T_j / sum_j w_j`` (weighted iterations per second,
each job counted against itself at all-max). Energy: of one iteration of every job, against
the same at all-max. A method whose draw stays above the budget (a locked clock with no clock
low enough; a cap below what the lowest clock draws) is reported as over budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from perseus_planner.power import JobPoints, allocate
from perseus_planner.sim.power_menu import JobModel, Measured, SimJob

METHODS = ("perseus", "gpu-cap", "locked-clock", "job-cap")
DEFAULT_MIX = (
    SimJob("gpt3-175b+a100_sxm", 24, 8),
    SimJob("bloom+a100_sxm", 24, 4),
    SimJob("gpt3-175b+a40", 12, 4, weight=2.0),
    SimJob("bloom+a40", 12, 2),
    SimJob("gpt3-175b+a100_sxm", 12, 2),
)
"""Two models on two GPUs, 16 to 64 GPUs a job, one job weighted double: 160 GPUs."""
BUDGET_STEP = 0.05
"""The sweep's step, as a fraction of the all-max draw."""


@dataclass(frozen=True)
class MethodOutcome:
    """One method at one budget.

    Attributes:
        method: Its name.
        power_w: Total draw of the mix.
        throughput_kept: Weighted iterations per second against all-max (1 = all-max).
        energy_ratio: Energy of one iteration of every job against all-max.
        within_budget: Whether ``power_w`` fits the budget.
        times_s: Each job's iteration time.
    """

    method: str
    power_w: float
    throughput_kept: float
    energy_ratio: float
    within_budget: bool
    times_s: tuple[float, ...]


@dataclass(frozen=True)
class BudgetRow:
    """Every method at one budget."""

    fraction: float
    budget_w: float
    outcomes: dict[str, MethodOutcome]


class PowerBudgetSim:
    """The mix and its reference numbers; :meth:`row` evaluates one budget."""

    def __init__(self, jobs: Sequence[JobModel]) -> None:
        self.jobs = list(jobs)
        self.all_max_w = math.fsum(j.all_max_power_w for j in self.jobs)
        self.num_gpus = sum(j.num_gpus for j in self.jobs)
        self._points = [
            JobPoints(j.spec.name, j.menu.times_s, j.menu.powers_w, j.spec.weight)
            for j in self.jobs
        ]
        grid = sorted({f for j in self.jobs for f in j.clock_grid()}, reverse=True)
        self._locked = [(f, self._measure_each([j.locked_clocks(f) for j in self.jobs]))
                        for f in grid]  # fmt: skip

    @property
    def least_fraction(self) -> float:
        """The lowest budget the allocation meets: every job at its least-power point."""
        return math.fsum(float(p.powers_w.min()) for p in self._points) / self.all_max_w

    @property
    def t_min_fraction(self) -> float:
        """The draw of every job's ``T_min`` plan (its frontier's fastest point)."""
        return (
            math.fsum(float(j.menu.powers_w[j.t_min_position]) for j in self.jobs) / self.all_max_w
        )

    def fractions(self) -> list[float]:
        """100 % down in steps, then the lowest feasible, and the ``T_min`` plans' draw."""
        low = self.least_fraction
        steps = [1.0 - BUDGET_STEP * k for k in range(int((1.0 - low) / BUDGET_STEP) + 1)]
        return sorted({*(round(s, 6) for s in steps if s >= low), low, self.t_min_fraction},
                      reverse=True)  # fmt: skip

    def row(self, fraction: float) -> BudgetRow:
        budget_w = fraction * self.all_max_w
        outcomes = {
            "perseus": self._perseus(budget_w),
            "gpu-cap": self._capped(
                "gpu-cap", budget_w, [budget_w / self.num_gpus] * len(self.jobs)
            ),
            "locked-clock": self._locked_clock(budget_w),
            "job-cap": self._capped(
                "job-cap",
                budget_w,
                [budget_w * j.all_max_power_w / self.all_max_w / j.num_gpus for j in self.jobs],
            ),
        }
        return BudgetRow(fraction, budget_w, outcomes)

    def _outcome(self, method: str, budget_w: float, each: list[Measured]) -> MethodOutcome:
        times = [float(m.times_s[0]) for m in each]
        powers = [float(m.powers_w[0]) for m in each]
        weights = [j.spec.weight for j in self.jobs]
        kept = math.fsum(
            w * j.all_max_time_s / t for w, j, t in zip(weights, self.jobs, times, strict=True)
        ) / math.fsum(weights)
        energy = math.fsum(p * t for p, t in zip(powers, times, strict=True))
        reference = math.fsum(j.all_max_power_w * j.all_max_time_s for j in self.jobs)
        total_w = math.fsum(powers)
        within = total_w <= budget_w * (1 + 1e-9)
        return MethodOutcome(method, total_w, kept, energy / reference, within, tuple(times))

    def _measure_each(self, clocks: list[np.ndarray]) -> list[Measured]:
        return [j.measure([c]) for j, c in zip(self.jobs, clocks, strict=True)]

    def _perseus(self, budget_w: float) -> MethodOutcome:
        result = allocate(self._points, budget_w)
        each = [
            Measured(j.menu.times_s[[s.index]], j.menu.powers_w[[s.index]])
            for j, s in zip(self.jobs, result.shares, strict=True)
        ]
        return self._outcome("perseus", budget_w, each)

    def _capped(self, method: str, budget_w: float, caps_w: list[float]) -> MethodOutcome:
        clocks = [j.capped_clocks(c) for j, c in zip(self.jobs, caps_w, strict=True)]
        return self._outcome(method, budget_w, self._measure_each(clocks))

    def _locked_clock(self, budget_w: float) -> MethodOutcome:
        for _, each in self._locked:
            if math.fsum(float(m.powers_w[0]) for m in each) <= budget_w * (1 + 1e-9):
                return self._outcome("locked-clock", budget_w, each)
        return self._outcome("locked-clock", budget_w, self._locked[-1][1])


def sweep(sim: PowerBudgetSim, fractions: Sequence[float] | None = None) -> list[BudgetRow]:
    """Every method at every budget (default: :meth:`PowerBudgetSim.fractions`)."""
    return [sim.row(f) for f in (sim.fractions() if fractions is None else fractions)]
