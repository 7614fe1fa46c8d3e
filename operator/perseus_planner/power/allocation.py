"""Choose each job's frontier point so that a power domain stays within its budget.

Every managed job offers the points of its iteration time–energy frontier as (iteration time,
average power of all its GPUs). The allocation picks one point per job that minimizes the
weighted sum of slowdowns ``w_j * (T_j / T_min_j - 1)`` subject to

    sum_j power_j + unmanaged_w <= budget_w.

A job behind a straggler cannot run faster than the straggler's ``T'`` (its ``floor_s``): its
points faster than that count at ``T'`` (no gain, so the slowest of them, which draws the least,
is the one kept), and its slowdown is measured from ``T_min`` all the same, so that a straggler
costs the budget nothing. The optimum is exact on the points given (:mod:`._mckp`); the tests
check it against brute force.

When even every job's least-power point does not fit, the result says by how many watts
(:attr:`Allocation.missing_w`) and chooses those least-power points: the closest one can come.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_planner.errors import PlannerError
from perseus_planner.power import _mckp

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

FEASIBILITY_TOLERANCE = 1e-12
"""Relative float noise on watts (of the budget) and costs that the search tolerates."""

OPTIMALITY_TOLERANCE = 1e-9
"""Default: the mean slowdown is within 1e-9 (1e-7 percentage points) of the optimum's.

Proving that no choice is better by less than that can take seconds on a thousand smooth
frontiers, where thousands of fills of the last watts differ in the tenth decimal."""


class PowerBudgetError(PlannerError):
    """Input the allocation cannot use (no points, a negative power, a weight of zero)."""


@dataclass(frozen=True)
class JobPoints:
    """One job's frontier as the allocation sees it.

    Attributes:
        name: Names the job in results and errors.
        times_s: Iteration time of each point (seconds, > 0).
        powers_w: Average power of every GPU of the job at each point (watts, >= 0):
            energy per iteration / iteration time, times the data-parallel replicas.
        weight: How much a unit of this job's slowdown counts (> 0).
        floor_s: The straggler's iteration time ``T'`` when the job has one, else ``None``.
    """

    name: str
    times_s: FloatArray
    powers_w: FloatArray
    weight: float = 1.0
    floor_s: float | None = None

    def __post_init__(self) -> None:
        times = np.asarray(self.times_s, dtype=np.float64)
        powers = np.asarray(self.powers_w, dtype=np.float64)
        object.__setattr__(self, "times_s", times)
        object.__setattr__(self, "powers_w", powers)
        if times.ndim != 1 or times.shape != powers.shape or len(times) == 0:
            raise PowerBudgetError(
                f"job {self.name}: needs one power per iteration time and at least one point "
                f"(got {times.shape} times and {powers.shape} powers)"
            )
        if not (np.all(np.isfinite(times)) and np.all(times > 0)):
            raise PowerBudgetError(f"job {self.name}: iteration times must be finite and > 0 s")
        if not (np.all(np.isfinite(powers)) and np.all(powers >= 0)):
            raise PowerBudgetError(f"job {self.name}: powers must be finite and >= 0 W")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise PowerBudgetError(f"job {self.name}: weight must be > 0, got {self.weight}")
        if self.floor_s is not None and not (math.isfinite(self.floor_s) and self.floor_s > 0):
            raise PowerBudgetError(f"job {self.name}: straggler floor must be > 0 s")

    @property
    def t_min_s(self) -> float:
        return float(self.times_s.min())

    def slowdowns(self) -> FloatArray:
        """``T / T_min - 1`` of each point, ``T`` no faster than the straggler floor."""
        effective = self.times_s
        if self.floor_s is not None:
            effective = np.maximum(effective, self.floor_s)
        result: FloatArray = effective / self.t_min_s - 1.0
        return result


@dataclass(frozen=True)
class JobShare:
    """What one job was given.

    Attributes:
        name: The job.
        index: The chosen point (index into its ``times_s``).
        time_s: Its iteration time (no faster than the straggler floor).
        power_w: Its average power.
        slowdown: ``time_s / T_min - 1``.
    """

    name: str
    index: int
    time_s: float
    power_w: float
    slowdown: float


@dataclass(frozen=True)
class Allocation:
    """The result of :func:`allocate`.

    Attributes:
        shares: One per job, in the order given.
        budget_w: The budget.
        unmanaged_w: Watts of GPUs no job manages (measured).
        objective: Weighted sum of slowdowns of the choice.
        missing_w: Watts above the budget even at every job's least power (0 when it fits).
        states: Work the exact search did (dynamic-programming states kept).
        lower_bound: No choice has a smaller weighted slowdown (the linear relaxation's
            optimum; equal to ``objective`` when the budget binds no job or every job).
    """

    shares: tuple[JobShare, ...]
    budget_w: float
    unmanaged_w: float
    objective: float
    missing_w: float
    states: int
    lower_bound: float

    @property
    def feasible(self) -> bool:
        return self.missing_w == 0.0

    @property
    def allocated_w(self) -> float:
        """Watts of the managed jobs' chosen points."""
        return math.fsum(s.power_w for s in self.shares)

    @property
    def headroom_w(self) -> float:
        """Watts under the budget (negative when infeasible)."""
        return self.budget_w - self.unmanaged_w - self.allocated_w


def allocate(
    jobs: Sequence[JobPoints],
    budget_w: float,
    unmanaged_w: float = 0.0,
    *,
    optimality_tolerance: float = OPTIMALITY_TOLERANCE,
) -> Allocation:
    """The choice of one point per job with the least weighted slowdown within the budget.

    Args:
        jobs: The managed jobs.
        budget_w: Watts the domain's GPUs may draw on average.
        unmanaged_w: Measured watts of the domain's GPUs that no job manages.
        optimality_tolerance: The choice's weighted slowdown is within this times the sum of
            the weights of the optimum (0: exactly the optimum, up to float noise, which can
            take much longer on many smooth frontiers).

    Raises:
        PowerBudgetError: A budget or unmanaged draw that is not a finite number of watts.
    """
    if not (math.isfinite(budget_w) and budget_w >= 0):
        raise PowerBudgetError(f"budget must be a finite number of watts >= 0, got {budget_w}")
    if not (math.isfinite(unmanaged_w) and unmanaged_w >= 0):
        raise PowerBudgetError(f"unmanaged draw must be finite and >= 0 W, got {unmanaged_w}")
    available_w = budget_w - unmanaged_w
    if not jobs:
        missing = max(0.0, -available_w)
        return Allocation((), budget_w, unmanaged_w, 0.0, missing, 0, 0.0)
    sizes = np.array([len(job.times_s) for job in jobs], dtype=np.int64)
    ptr = np.zeros(len(jobs) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    power = np.concatenate([job.powers_w for job in jobs])
    cost = _costs(jobs, ptr, sizes)
    par_ptr, par_idx, hull_ptr, hull_pos = _mckp.pareto_hulls(ptr, power, cost)
    par_power, par_cost = power[par_idx], cost[par_idx]
    least_w = float(par_power[par_ptr[:-1]].sum())
    most_w = float(par_power[par_ptr[1:] - 1].sum())
    tol_w = FEASIBILITY_TOLERANCE * max(budget_w, 1.0)
    states = 0
    lower_bound: float | None = None
    if least_w > available_w + tol_w:
        choice = par_ptr[:-1]
        missing = least_w - available_w
    elif most_w <= available_w + tol_w:
        choice = par_ptr[1:] - 1
        missing = 0.0
    else:
        missing = 0.0
        hull_power = par_power[hull_pos]
        hull_cost = par_cost[hull_pos]
        pos, lam, slack_w = _mckp.lp_break(hull_ptr, hull_power, hull_cost, available_w - least_w)
        start = hull_pos[hull_ptr[:-1] + pos]
        tol_cost = FEASIBILITY_TOLERANCE * (1.0 + float(par_cost.max()) + lam * most_w)
        margin = max(tol_cost, optimality_tolerance * float(sum(job.weight for job in jobs)))
        choice, states = _exact_choice(par_ptr, par_power, par_cost, start, lam, slack_w,
                                       tol_cost, tol_w, margin)  # fmt: skip
        lower_bound = float(par_cost[start].sum()) - lam * slack_w
    chosen = par_idx[choice]
    shares = []
    for j, job in enumerate(jobs):
        i = int(chosen[j] - ptr[j])
        time_s = float(job.times_s[i])
        if job.floor_s is not None:
            time_s = max(time_s, job.floor_s)
        slowdown = float(cost[chosen[j]]) / job.weight
        shares.append(JobShare(job.name, i, time_s, float(job.powers_w[i]), slowdown))
    objective = math.fsum(cost[chosen].tolist())
    if lower_bound is None:  # every job at its least power, or at its least cost: optimal
        lower_bound = objective
    return Allocation(tuple(shares), budget_w, unmanaged_w, objective, missing, states, lower_bound)


BEAM_STATES = 32
"""States per job of the heuristic pass that finds the incumbent for the exact one."""


def _exact_choice(
    par_ptr: IntArray,
    par_power: FloatArray,
    par_cost: FloatArray,
    start: IntArray,
    lam: float,
    slack_w: float,
    tol_cost: float,
    tol_w: float,
    margin: float,
) -> tuple[IntArray, int]:
    """The optimum from the greedy solution: a beam pass finds a choice close to the bound
    fast; the exact search then only has to look below that (far fewer candidate points)."""
    args = (par_ptr, par_power, par_cost, start, lam, slack_w)
    found, gap, beam_states = _mckp.refine(
        *args, lam * slack_w, BEAM_STATES, tol_cost, tol_w, tol_cost
    )
    incumbent = start if found[0] < 0 else found
    better, _, states = _mckp.refine(*args, gap, 0, tol_cost, tol_w, margin)
    return (incumbent if better[0] < 0 else better), beam_states + states


def _costs(jobs: Sequence[JobPoints], ptr: IntArray, sizes: IntArray) -> FloatArray:
    """Weighted slowdown of every point of every job, flattened (one pass, not one per job)."""
    times = np.concatenate([job.times_s for job in jobs])
    floors = np.array([job.floor_s or 0.0 for job in jobs], dtype=np.float64)
    weights = np.array([job.weight for job in jobs], dtype=np.float64)
    t_min = np.minimum.reduceat(times, ptr[:-1])
    effective = np.maximum(times, np.repeat(floors, sizes))
    result: FloatArray = np.repeat(weights, sizes) * (effective / np.repeat(t_min, sizes) - 1.0)
    return result
