"""Runs of a data-parallel job under one method, with an optional straggler, and their summary.

Straggler model: from iteration ``onset`` on, replica ``straggler_replica`` takes ``factor``
times longer for every computation at the same energy per computation (its power drops by
``factor``). That is what a throttled or externally slowed GPU looks like to the job: the same
work stretched in time, which the paper abstracts as a slower iteration time ``T'``. Keeping its
energy the profile's (rather than its power) means the straggler's own energy does not depend on
which method the healthy replicas run, so the methods differ only in what they can control.
The straggler keeps the clocks it had before; the other replicas learn ``T'`` (the straggler's
iteration time) and each method may re-plan for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perseus_planner.errors import PlannerError
from perseus_planner.sim.engine import Assignment, FloatArray, RunResult, measure_assignments
from perseus_planner.sim.engine import simulate_run as combine_replicas
from perseus_planner.sim.methods import METHODS, SimSetup


@dataclass(frozen=True)
class Scenario:
    """Shape of the simulated run.

    Attributes:
        num_replicas: Data-parallel pipelines.
        num_iterations: Iterations simulated.
        straggler_factor: ``T' / T`` of the straggler (1 for none).
        straggler_onset: First iteration the straggler is slow (>= num_iterations: never).
        straggler_replica: Which replica straggles.
    """

    num_replicas: int
    num_iterations: int
    straggler_factor: float = 1.0
    straggler_onset: int = 0
    straggler_replica: int = 0

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_iterations < 1:
            raise PlannerError("need at least one replica and one iteration")
        if not (np.isfinite(self.straggler_factor) and self.straggler_factor >= 1.0):
            raise PlannerError(f"straggler factor must be >= 1, got {self.straggler_factor}")
        if self.straggler_onset < 0:
            raise PlannerError(f"straggler onset must be >= 0, got {self.straggler_onset}")
        if not 0 <= self.straggler_replica < self.num_replicas:
            raise PlannerError(
                f"straggler replica {self.straggler_replica} out of range "
                f"0..{self.num_replicas - 1}"
            )

    @property
    def has_straggler(self) -> bool:
        return self.straggler_factor > 1.0 and self.straggler_onset < self.num_iterations


@dataclass(frozen=True)
class MethodRun:
    """One method's simulated run.

    Attributes:
        method: Its name.
        assignments: ``[before the straggler, healthy replicas after it]`` (one if no straggler).
        result: Per-iteration times and energies.
        baseline_energies_j: ``(I,)`` energy of all GPUs at max clock stretched to the same
            iteration times (the comparison savings are quoted against).
    """

    method: str
    assignments: list[Assignment]
    result: RunResult
    baseline_energies_j: FloatArray

    @property
    def savings_ratio(self) -> float:
        """Energy saved over the run vs all-max at the same iteration times."""
        return 1.0 - float(self.result.energies_j.sum() / self.baseline_energies_j.sum())


def run_method(
    setup: SimSetup, method: str, scenario: Scenario, *, retarget: bool = True
) -> MethodRun:
    """Simulate ``scenario`` with every replica running ``method``.

    Args:
        retarget: Whether healthy replicas re-plan once the straggler appears.
    """
    try:
        plan_clocks = METHODS[method]
    except KeyError:
        raise PlannerError(f"unknown method {method!r}; choose from {', '.join(METHODS)}") from None
    before = plan_clocks(setup, None)
    clocks = [before]
    first = measure_assignments(setup.graph, setup.table, [before])[0]
    if scenario.has_straggler and retarget:
        clocks.append(plan_clocks(setup, scenario.straggler_factor * first.time_s))
    assignments = [first, *measure_assignments(setup.graph, setup.table, clocks[1:])]

    shape = (scenario.num_iterations, scenario.num_replicas)
    choice = np.zeros(shape, dtype=np.int64)
    slowdown = np.ones(shape, dtype=np.float64)
    if scenario.has_straggler:
        onset, straggler = scenario.straggler_onset, scenario.straggler_replica
        if retarget:
            choice[onset:, :] = 1
            choice[onset:, straggler] = 0
        slowdown[onset:, straggler] = scenario.straggler_factor
    result = combine_replicas(
        assignments, choice, slowdown, setup.num_stages, setup.blocking_power_w
    )
    baseline = _all_max_run(setup, scenario)
    return MethodRun(method, assignments, result, baseline.energy_at_j(result.times_s))


def _all_max_run(setup: SimSetup, scenario: Scenario) -> RunResult:
    base = setup.baseline
    assignment = Assignment(
        setup.table.max_frequencies_mhz(), base.time_s, base.busy_time_s, base.busy_energy_j
    )
    shape = (scenario.num_iterations, scenario.num_replicas)
    slowdown = np.ones(shape, dtype=np.float64)
    if scenario.has_straggler:
        slowdown[scenario.straggler_onset :, scenario.straggler_replica] = scenario.straggler_factor
    return combine_replicas(
        [assignment],
        np.zeros(shape, dtype=np.int64),
        slowdown,
        setup.num_stages,
        setup.blocking_power_w,
    )


@dataclass(frozen=True)
class Summary:
    """What the report shows for one method (means over the run's iterations)."""

    method: str
    iteration_time_s: float
    energy_j: float
    savings_ratio: float
    slowdown_ratio: float  # mean iteration time / T_min - 1


def summarize(setup: SimSetup, run: MethodRun) -> Summary:
    t_min_s = float(setup.frontier.times_s[setup.frontier.t_min_index])
    mean_s = float(run.result.times_s.mean())
    return Summary(
        run.method,
        mean_s,
        float(run.result.energies_j.mean()),
        run.savings_ratio,
        mean_s / t_min_s - 1.0,
    )
