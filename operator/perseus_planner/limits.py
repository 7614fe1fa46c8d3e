"""What the solver's integer arithmetic and memory can hold, checked before it runs.

The frontier solver (:mod:`perseus_planner.solver`, :mod:`perseus_planner._kernel`) works in
integer micro-joules, with ``2**50`` µJ standing for "infinite", and in integer time units,
with one table entry per (stage, instruction) and duration and one solver step per time
unit of the frontier. Input that is finite but extreme (an energy of 1e300 J, a unit time of
1e-12 s, a million microbatches) used to overflow that arithmetic, allocate tens of
gigabytes or run for hours. :func:`prepare_problem` refuses such input up front, each time
with a message that states the limit and what to change; the CLI and the operator both
plan through it.

Checks, in order (each bounds the memory and time of the next step):

1. before the DAG is built: the number of computations;
2. before the tables are built: duration steps per (stage, instruction) and in all, and an
   upper bound on any cut capacity (measured energy and blocking power, in micro-joules);
3. after the cost models are fit, before solving: every fitted computation energy is finite
   and positive, and frontier points x computations (the solver's work) is within the limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from perseus_api.profile import Profile
from perseus_api.schedule import check_schedule_sizes
from perseus_planner import _kernel
from perseus_planner.dag import Schedule, build_pipeline_dag
from perseus_planner.errors import LimitError
from perseus_planner.model_stages import schedule_profile, solver_profile
from perseus_planner.solver import CAPACITY_QUANTUM_J, FrontierProblem, build_problem

__all__ = [
    "MAX_CUT_ENERGY_J",
    "MAX_QUANT_UNITS",
    "PlannerLimits",
    "check_inputs",
    "check_problem",
    "check_target",
    "expected_frontier_points",
    "prepare_problem",
]

MAX_CUT_ENERGY_J = float(_kernel.INF_UNITS) * CAPACITY_QUANTUM_J / 16
"""Largest total energy any cut may carry: a sixteenth of the kernel's "infinite" capacity
(2**50 µJ), so that no finite cut, rounded up per arc and with the fitted cost model
overshooting the measurements, is ever taken for an uncuttable one."""

MAX_QUANT_UNITS = 2**53
"""Largest duration, in time units, that float64 still counts exactly (and int64 holds)."""

COMPUTATIONS_PER_MICROBATCH_AND_STAGE = 2
"""A forward and a backward per model stage (three with a split backward: ZB-H1)."""


@dataclass(frozen=True)
class PlannerLimits:
    """Bounds on the size of one solve; the defaults fit a laptop and a planner pod.

    Attributes:
        max_computations: Forwards and backwards in one iteration's DAG (stages x 2 x
            microbatches); each costs a few hundred bytes before solving starts.
        max_duration_steps: Table entries over all (stage, instruction): the durations from
            each one's fastest to its slowest option, in time units (32 bytes each).
        max_solver_work: Frontier points x computations: each point is one max-flow over
            the DAG, about a microsecond per computation, and the frontier is kept in memory.
    """

    max_computations: int = 500_000
    max_duration_steps: int = 2_000_000
    max_solver_work: int = 2_000_000_000

    def __post_init__(self) -> None:
        for name in ("max_computations", "max_duration_steps", "max_solver_work"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LimitError(f"{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = PlannerLimits()


def prepare_problem(
    profile: Profile,
    schedule: Schedule | str,
    num_stages: int,
    num_microbatches: int,
    unit_time_s: float,
    blocking_power_w: float,
    limits: PlannerLimits = DEFAULT_LIMITS,
    *,
    virtual_stages: int = 1,
) -> FrontierProblem:
    """Check the input against ``limits``, build the DAG and the problem, check it again.

    ``num_stages`` counts GPUs (pipeline stages); with ``virtual_stages`` (interleaved 1F1B)
    the profile has ``num_stages * virtual_stages`` model stages
    (:mod:`perseus_planner.model_stages`).

    Raises:
        LimitError: The input is beyond what the solver can hold (the message says which
            limit and what to change).
        PlannerError: Any other reason the input cannot be planned (from the builders).
    """
    sched = check_schedule_sizes(schedule, num_stages, num_microbatches, virtual_stages)
    if profile.num_stages == num_stages * virtual_stages:
        # Only the model stages and instructions the schedule runs count towards the limits.
        profile = schedule_profile(profile, sched, num_stages, num_microbatches, virtual_stages)
    check_inputs(
        profile,
        num_stages * virtual_stages,
        num_microbatches,
        unit_time_s,
        blocking_power_w,
        limits,
        computations_per_stage_and_microbatch=len(sched.instructions),
    )
    dag = build_pipeline_dag(sched, num_stages, num_microbatches, virtual_stages)
    problem = build_problem(solver_profile(profile, dag), dag, unit_time_s, blocking_power_w)
    check_problem(problem, limits)
    return problem


def check_inputs(
    profile: Profile,
    num_stages: int,
    num_microbatches: int,
    unit_time_s: float,
    blocking_power_w: float,
    limits: PlannerLimits = DEFAULT_LIMITS,
    *,
    computations_per_stage_and_microbatch: int = COMPUTATIONS_PER_MICROBATCH_AND_STAGE,
) -> None:
    """Checks that need neither the DAG nor the tables (cheap: one pass over the profile).

    ``num_stages`` counts model stages (with virtual stages, more than the GPUs).

    Raises:
        LimitError: see :func:`prepare_problem`.
    """
    if not (math.isfinite(unit_time_s) and unit_time_s > 0):
        raise LimitError(f"unit time must be a positive number of seconds, got {unit_time_s}")
    if not (math.isfinite(blocking_power_w) and blocking_power_w >= 0):
        raise LimitError(f"blocking power must be a number >= 0 W, got {blocking_power_w}")
    computations = computations_per_stage_and_microbatch * num_stages * num_microbatches
    if computations > limits.max_computations:
        raise LimitError(
            f"{num_stages} stages x {num_microbatches} microbatches make {computations:,} "
            f"forwards and backwards per iteration, above the planner's limit of "
            f"{limits.max_computations:,} (memory for the DAG and its tables); plan for fewer "
            "microbatches"
        )
    steps = 0
    cut_bound_j = 0.0
    for (stage, instruction), m in sorted(profile.measurements.items()):
        if stage >= num_stages:
            continue  # a stage-count mismatch is reported by build_problem, with its reason
        label = f"stage {stage} {instruction}"
        t_min_s, t_max_s = float(m.times_s.min()), float(m.times_s.max())
        # Computed in floats so that an absurd ratio cannot overflow on the way to the check.
        slowest_units = t_max_s / unit_time_s
        if slowest_units > MAX_QUANT_UNITS:
            raise LimitError(
                f"{label} takes up to {t_max_s:g} s, {slowest_units:.3g} time units of "
                f"{unit_time_s:g} s; at most 2**53 units can be counted exactly; use a larger "
                "unit time or check that the profile's times are seconds"
            )
        steps += math.floor(slowest_units) - math.floor(t_min_s / unit_time_s) + 1
        if steps > limits.max_duration_steps:
            raise LimitError(
                f"the unit time {unit_time_s:g} s gives more than {limits.max_duration_steps:,} "
                f"duration steps over the profile's computations ({label} alone spans "
                f"{t_min_s:g}..{t_max_s:g} s); use a unit time of at least "
                f"{_min_unit_time_s(profile, num_stages, limits.max_duration_steps):.3g} s"
            )
        # |fitted cost| <= energy + blocking power x time, at every duration; a cut's capacity
        # is at most the sum of cost differences over the computations it crosses.
        bound_j = float(m.energies_j.max()) + blocking_power_w * t_max_s
        cut_bound_j += num_microbatches * bound_j
    if not cut_bound_j <= MAX_CUT_ENERGY_J:
        raise LimitError(
            f"one iteration's energy bound is {cut_bound_j:.3g} J (over every computation: its "
            f"largest measured energy plus blocking power {blocking_power_w:g} W x its longest "
            f"time), above the planner's limit of {MAX_CUT_ENERGY_J:.3g} J (it counts integer "
            "micro-joules below 2**50); check that energies are joules, times seconds and the "
            "blocking power the watts of one GPU"
        )


def _min_unit_time_s(profile: Profile, num_stages: int, max_steps: int) -> float:
    """A unit time that keeps the duration steps within ``max_steps`` (with one to spare per
    table for the floors)."""
    spans = [
        float(m.times_s.max() - m.times_s.min())
        for (stage, _), m in profile.measurements.items()
        if stage < num_stages
    ]
    room = max(max_steps - 2 * len(spans), 1)
    return sum(spans) / room


def check_problem(problem: FrontierProblem, limits: PlannerLimits = DEFAULT_LIMITS) -> int:
    """Checks of the fitted problem before solving; returns the expected frontier points.

    Raises:
        LimitError: see :func:`prepare_problem`.
    """
    p = problem
    for (stage, instruction), model in sorted(p.models.items()):
        opts = model.options
        durations = np.arange(opts.min_quant_time, opts.max_quant_time + 1, dtype=np.int64)
        with np.errstate(over="ignore", invalid="ignore"):  # reported below, as a refusal
            cost_j = model.cost_model(durations)
            energy_j = cost_j + p.blocking_power_w * durations * p.unit_time_s
        worst = int(np.argmin(np.where(np.isfinite(energy_j), energy_j, -np.inf)))
        if not (np.all(np.isfinite(cost_j)) and float(energy_j[worst]) > 0):
            raise LimitError(
                f"stage {stage} {instruction}: the cost model fit to its measurements gives "
                f"{float(energy_j[worst]):.4g} J at {int(durations[worst]) * p.unit_time_s:g} s "
                "(energy must be finite and positive); the profile's energies are "
                f"inconsistent (measured {_range(opts.energies_j.tolist())} J): check for an "
                "outlier row or a unit mix-up"
            )
    points = expected_frontier_points(p)
    work = points * p.dag.num_nodes
    if work > limits.max_solver_work:
        raise LimitError(
            f"the frontier would have about {points:,} points over {p.dag.num_nodes:,} "
            f"computations ({work:,} point-computations, about a microsecond each), above the "
            f"planner's limit of {limits.max_solver_work:,}; use a larger unit time or fewer "
            "microbatches (or raise the limit: perseus plan --max-solver-work)"
        )
    return points


def expected_frontier_points(problem: FrontierProblem) -> int:
    """Upper bound on the frontier's points: one per time unit from ``T_max`` to ``T_min``."""
    slowest = problem.makespan(problem.slowest_durations)
    fastest = problem.makespan(problem.fastest_durations)
    return slowest - fastest + 1


def check_target(target_s: float, unit_time_s: float) -> None:
    """A straggler target must be a time the planner can count in its units.

    Raises:
        LimitError: not finite, not positive, or more than 2**53 time units.
    """
    if not (math.isfinite(target_s) and target_s > 0):
        raise LimitError(f"target iteration time must be > 0 s (and finite), got {target_s}")
    if target_s / unit_time_s > MAX_QUANT_UNITS:
        raise LimitError(
            f"target iteration time {target_s:g} s is more than 2**53 time units of "
            f"{unit_time_s:g} s; at most {MAX_QUANT_UNITS * unit_time_s:.6g} s can be planned for"
        )


def _range(values: Iterable[float]) -> str:
    listed = list(values)
    return f"{min(listed):.4g}..{max(listed):.4g}"
