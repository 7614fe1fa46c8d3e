"""A solved frontier as the allocation's points: (iteration time, average power of the job).

The frontier's energies come from the exponential cost fits that make its search convex; they
are off the profile's measured rows by a few percent (more at the slowest clocks). The watts a
budget is met with must be the measured ones, so every point's clocks are replayed on the
profile's rows (as :func:`perseus_planner.plan.build_plan` estimates a plan): the computations'
measured energies, plus blocking power for the rest of the point's iteration time on every GPU.
Times stay the frontier's, the ones a re-targeted plan is chosen by.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from perseus_planner.frontier import Frontier
from perseus_planner.power.allocation import JobPoints, PowerBudgetError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MAX_POINTS = 1000
"""Points kept per job: all of them up to this; beyond, the last ``NEAR_T_MIN`` (where budgets
first bite) and the rest evenly spaced."""
NEAR_T_MIN = 200


def sampled_indices(num_points: int, max_points: int = MAX_POINTS) -> IntArray:
    """Frontier indices kept (ascending: slowest first, ``T_min`` last)."""
    if num_points <= max_points:
        return np.arange(num_points, dtype=np.int64)
    near = min(NEAR_T_MIN, max_points // 2)
    spread = np.linspace(0, num_points - near, max_points - near, dtype=np.int64)
    tail = np.arange(num_points - near, num_points, dtype=np.int64)
    return np.unique(np.concatenate([spread, tail]))


def replayed_energies_j(frontier: Frontier, indices: IntArray) -> FloatArray:
    """Energy of one iteration of one pipeline at each point, on the profile's measured rows
    (blocking power until the point's frontier time on every GPU)."""
    problem = frontier.problem
    dag = problem.dag
    clocks = np.stack([frontier.frequencies_at(int(i)) for i in indices.tolist()])
    busy_j = np.zeros(len(indices))
    busy_s = np.zeros(len(indices))
    groups: dict[tuple[int, str], list[int]] = {}
    for v, comp in enumerate(dag.computations):
        groups.setdefault((comp.stage, comp.instruction), []).append(v)
    for (stage, instruction), nodes in groups.items():
        m = problem.profile.get(stage, instruction)
        order = np.argsort(m.frequencies_mhz, kind="stable")
        freqs = np.asarray(m.frequencies_mhz)[order]
        asked = clocks[:, nodes]
        pos = np.minimum(np.searchsorted(freqs, asked), len(freqs) - 1)
        if np.any(freqs[pos] != asked):
            raise PowerBudgetError(f"stage {stage} {instruction}: a planned clock is not profiled")
        rows = order[pos]
        busy_j += np.asarray(m.energies_j)[rows].sum(axis=1)
        busy_s += np.asarray(m.times_s)[rows].sum(axis=1)
    times_s = frontier.times_s[indices]
    idle_s = np.maximum(problem.num_stages * times_s - busy_s, 0.0)
    result: FloatArray = busy_j + problem.blocking_power_w * idle_s
    return result


def frontier_points(
    name: str,
    frontier: Frontier,
    replicas: int,
    *,
    weight: float = 1.0,
    floor_s: float | None = None,
    max_points: int = MAX_POINTS,
) -> tuple[JobPoints, IntArray]:
    """The job's points for :func:`perseus_planner.power.allocate`, and the frontier index of
    each (a chosen point's ``index`` maps back to ``indices[index]``).

    Args:
        replicas: Data-parallel pipelines of the job (its watts are the pipeline's times this).
        floor_s: The straggler's ``T'`` in frontier time, when the job has one.
    """
    if replicas < 1:
        raise PowerBudgetError(f"job {name}: needs at least one replica, got {replicas}")
    indices = sampled_indices(len(frontier), max_points)
    powers_w = replicas * replayed_energies_j(frontier, indices) / frontier.times_s[indices]
    points = JobPoints(name, frontier.times_s[indices], powers_w, weight, floor_s)
    return points, indices
