"""Runs of a data-parallel job under one method, with an optional straggler, and their summary.

Straggler model: from iteration ``onset`` on, replica ``straggler_replica`` takes ``factor``
times longer for every computation at the same energy per computation (its power drops by
``factor``). That is what a throttled or externally slowed GPU looks like to the job: the same
work stretched in time, which the paper abstracts as a slower iteration time ``T'``. Keeping its
energy the profile's (rather than its power) means the straggler's own energy does not depend on
which method the healthy replicas run, so the methods differ only in what they can control.
The other replicas learn ``T'`` (the straggler's iteration time) and each method may re-plan for
it. The straggler itself either keeps the clocks its method gave it (``straggler_clocks="own"``,
what the operator does) or runs every GPU at max clock under every method (``"max"``, the
paper's large-scale emulation: its energy is then the same for every method and the baseline,
see :mod:`perseus_planner.sim.emulation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from perseus_planner.errors import PlannerError
from perseus_planner.sim.engine import Assignment, FloatArray, RunResult, measure_assignments
from perseus_planner.sim.engine import simulate_run as combine_replicas
from perseus_planner.sim.methods import METHODS, STRAGGLER_BLIND, SimSetup

StragglerClocks = Literal["own", "max"]
STRAGGLER_CLOCKS: tuple[str, ...] = get_args(StragglerClocks)

PlanCache = dict[tuple[str, float | None], Assignment]
"""Measured plans of one setup by (method, target ``T'``), shared by runs of that setup."""


@dataclass(frozen=True)
class Scenario:
    """Shape of the simulated run.

    Attributes:
        num_replicas: Data-parallel pipelines.
        num_iterations: Iterations simulated.
        straggler_factor: ``T' / T`` of the straggler (1 for none).
        straggler_onset: First iteration the straggler is slow (>= num_iterations: never).
        straggler_replica: Which replica straggles.
        straggler_clocks: From the onset the straggler keeps its method's clocks (``own``) or
            runs every GPU at max clock whatever the method (``max``).
    """

    num_replicas: int
    num_iterations: int
    straggler_factor: float = 1.0
    straggler_onset: int = 0
    straggler_replica: int = 0
    straggler_clocks: StragglerClocks = "own"

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
        if self.straggler_clocks not in STRAGGLER_CLOCKS:
            raise PlannerError(
                f"straggler clocks must be one of {', '.join(STRAGGLER_CLOCKS)}, "
                f"got {self.straggler_clocks!r}"
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
    setup: SimSetup,
    method: str,
    scenario: Scenario,
    *,
    retarget: bool = True,
    plan_cache: PlanCache | None = None,
) -> MethodRun:
    """Simulate ``scenario`` with every replica running ``method``.

    Args:
        retarget: Whether healthy replicas re-plan once the straggler appears.
        plan_cache: Plans measured by earlier runs of the same ``setup`` (filled in here), so that
            sweeps over many stragglers plan each (method, ``T'``) once.
    """
    if method not in METHODS:
        raise PlannerError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    cache: PlanCache = {} if plan_cache is None else plan_cache
    first = _planned(setup, method, None, cache)
    straggler = _all_max_assignment(setup) if scenario.straggler_clocks == "max" else first
    assignments = [first]
    if scenario.has_straggler and retarget:
        target_s = scenario.straggler_factor * straggler.time_s
        assignments.append(_planned(setup, method, target_s, cache))
    pool = [*assignments, straggler]

    shape = (scenario.num_iterations, scenario.num_replicas)
    choice = np.zeros(shape, dtype=np.int64)
    slowdown = np.ones(shape, dtype=np.float64)
    if scenario.has_straggler:
        onset, replica = scenario.straggler_onset, scenario.straggler_replica
        if retarget:
            choice[onset:, :] = 1
        choice[onset:, replica] = len(pool) - 1
        slowdown[onset:, replica] = scenario.straggler_factor
    result = combine_replicas(pool, choice, slowdown, setup.num_stages, setup.blocking_power_w)
    baseline = _all_max_run(setup, scenario)
    return MethodRun(method, assignments, result, baseline.energy_at_j(result.times_s))


def _planned(setup: SimSetup, method: str, target_s: float | None, cache: PlanCache) -> Assignment:
    """The method's clocks for ``target_s``, measured; methods blind to stragglers plan once."""
    key = (method, None if method in STRAGGLER_BLIND else target_s)
    if key not in cache:
        clocks = METHODS[method](setup, target_s)
        (cache[key],) = measure_assignments(setup.graph, setup.table, [clocks])
    return cache[key]


def straggler_sweep(
    setup: SimSetup,
    methods: Sequence[str],
    factors: Sequence[float],
    num_replicas: int,
    straggler_clocks: StragglerClocks = "max",
) -> dict[str, FloatArray]:
    """Savings of each method at each ``T'/T`` (1: no straggler), one iteration per factor.

    Returns:
        ``method -> (len(factors),)`` energy saved vs all-max over the same iteration time.
    """
    cache: PlanCache = {}
    return {
        m: np.array(
            [
                run_method(
                    setup,
                    m,
                    Scenario(num_replicas, 1, f, 0, straggler_clocks=straggler_clocks),
                    plan_cache=cache,
                ).savings_ratio
                for f in factors
            ]
        )
        for m in methods
    }


def _all_max_assignment(setup: SimSetup) -> Assignment:
    base = setup.baseline
    return Assignment(
        setup.table.max_frequencies_mhz(), base.time_s, base.busy_time_s, base.busy_energy_j
    )


def _all_max_run(setup: SimSetup, scenario: Scenario) -> RunResult:
    shape = (scenario.num_iterations, scenario.num_replicas)
    slowdown = np.ones(shape, dtype=np.float64)
    if scenario.has_straggler:
        slowdown[scenario.straggler_onset :, scenario.straggler_replica] = scenario.straggler_factor
    return combine_replicas(
        [_all_max_assignment(setup)],
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
