"""The summary ``perseus plan`` prints, and the notes that say why its numbers are what they are.

The frontier's energies are the solver's fitted ones, the savings lines replay the plan's clocks
on the profile's measured rows (what ``plan.json`` records); all max clock can read slower than
``T_min`` because the solver floors each computation's time to its unit; a granularity that saves
nothing at the chosen target gets a hint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perseus_api import PipelinePlan, PlanEstimate
    from perseus_planner import Baseline, Choice, Frontier

__all__ = ["plan_summary"]


def plan_summary(
    source_name: str,
    blocking_power_w: float,
    frontier: Frontier,
    baseline: Baseline,
    choice: Choice,
    plan: PipelinePlan,
    solve_s: float,
    written: list[Path],
    compiled: bool | None = None,
) -> str:
    """What ``perseus plan`` prints: the frontier's points (fitted), the baseline, the chosen
    point and each granularity's replayed savings, with the notes that explain them."""
    unit_time_s = frontier.problem.unit_time_s
    digits = _time_digits(unit_time_s)

    def point(time_s: float, energy_j: float) -> str:
        return f"{time_s:.{digits}f} s  {energy_j:12,.1f} J"

    def at(index: int) -> str:
        return point(float(frontier.times_s[index]), float(frontier.energies_j[index]))

    def saved(est: PlanEstimate) -> str:
        shown = point(est.iteration_time_s, est.energy_j)
        saved_j, percent = _saved(est)
        return f"{shown}  saved {saved_j:,.1f} J ({percent:.2f} %)"

    objective = plan.objective.value
    if plan.target_iteration_time_s is not None:
        what = "T'" if objective == "Straggler" else "deadline"
        objective += f", {what} {plan.target_iteration_time_s:.{digits}f} s"
    stages = frontier.problem.num_stages
    dag = frontier.problem.dag
    if dag.virtual_stages > 1:
        stages_shown = f"{stages} stages x {dag.virtual_stages} virtual"
    else:
        stages_shown = f"{stages} stages"
    compile_note = " (most of it compiling the solver: first run only)" if compiled is False else ""
    lines = [
        f"Profile        {source_name}: {stages_shown}, {dag.schedule.value}, "
        f"{dag.num_microbatches} microbatches, unit {unit_time_s:g} s, "
        f"blocking {blocking_power_w:g} W",
        f"Frontier       {len(frontier)} points, solved in {solve_s:.2f} s{compile_note}",
        "  (energies of the solver's fitted cost model; times on its grid of one unit)",
        f"  T_max        {at(0)}  slowest point",
        f"  T*           {at(frontier.t_star_index)}  least energy",
        f"  T_min        {at(frontier.t_min_index)}  fastest, the default target",
        f"All max clock  {point(baseline.time_s, baseline.energy_j())}  the baseline",
        *_baseline_note(frontier, baseline, digits),
        f"Chosen         {at(choice.index)}  ({objective})",
        "Replayed on the profile's measured rows, saved vs all max clock at the same "
        "iteration time:",
        f"  instruction  {saved(plan.instruction_estimate)}",
        f"  stage        {saved(plan.stage_estimate)}",
        f"Plan applies   {plan.granularity.value} granularity",
        *_granularity_hint(plan),
        "Wrote",
        *(f"  {path}" for path in written),
    ]
    return "\n".join(lines)


_NOTHING_SAVED_RATIO = 0.0005
"""Below 0.05 % a plan saves nothing worth its clock changes: the summary says why."""


def _saved(est: PlanEstimate) -> tuple[float, float]:
    """Joules and percent saved, as in plan.json (rounded; never "-0.0")."""
    # The baseline energy is recovered from the plan's own ratio rather than recomputed, so
    # the numbers shown are exactly those in plan.json (a straggler target moves the
    # comparison to T', which the planner accounts for).
    saved_j = est.energy_j * est.savings_ratio / (1.0 - est.savings_ratio)
    # Adding 0.0 turns the "-0.0" of rounding noise (no saving at all) into "0.0".
    return round(saved_j, 1) + 0.0, round(100.0 * est.savings_ratio, 2) + 0.0


def _baseline_note(frontier: Frontier, baseline: Baseline, digits: int) -> list[str]:
    """Why all max clock can read slower than ``T_min``: the grid, not the clocks."""
    t_min_s = float(frontier.times_s[frontier.t_min_index])
    if baseline.time_s <= t_min_s:
        return []
    unit_s = frontier.problem.unit_time_s
    return [
        f"  slower than T_min only because the solver rounds each computation down to its "
        f"{unit_s:g} s unit: on that grid all max clock takes {_grid_time_s(frontier):.{digits}f} s"
    ]


def _grid_time_s(frontier: Frontier) -> float:
    """The all-max-clock iteration time with every computation floored to the unit time."""
    import numpy as np

    problem = frontier.problem
    unit_s = problem.unit_time_s
    times_s = np.empty(problem.dag.num_nodes, dtype=np.float64)
    for i, comp in enumerate(problem.dag.computations):
        m = problem.profile.get(comp.stage, comp.instruction)
        fastest = int(np.argmax(m.frequencies_mhz))
        times_s[i] = math.floor(float(m.times_s[fastest]) / unit_s + 1e-9) * unit_s
    return problem.real_makespan_s(times_s)


def _granularity_hint(plan: PipelinePlan) -> list[str]:
    """What to try when the plan's granularity saves nothing at the chosen target."""
    from perseus_api import Granularity, PlanObjective

    if plan.granularity is Granularity.STAGE:
        applied, other, other_name = plan.stage_estimate, plan.instruction_estimate, "instruction"
    else:
        applied, other, other_name = plan.instruction_estimate, plan.stage_estimate, "stage"
    if applied.savings_ratio >= _NOTHING_SAVED_RATIO:
        return []
    name = plan.granularity.value.lower()
    why = (
        "one clock per GPU cannot slow a stage whose computations are on the critical path"
        if plan.granularity is Granularity.STAGE
        else "every computation is on the critical path at this target"
    )
    tries = []
    if other.savings_ratio >= _NOTHING_SAVED_RATIO:
        tries.append(f"--granularity {other_name} ({_saved(other)[1]:.2f} %)")
    if plan.objective is PlanObjective.MIN_TIME:
        tries.append("a slowdown budget (e.g. --max-slowdown 0.02)")
    hint = f"  hint: {name} granularity saves nothing here: {why}"
    return [hint + (f"; try {' or '.join(tries)}" if tries else "")]


def _time_digits(unit_time_s: float) -> int:
    """Decimals that show one unit time (at least milliseconds)."""
    return max(3, math.ceil(-math.log10(unit_time_s) - 1e-9))
