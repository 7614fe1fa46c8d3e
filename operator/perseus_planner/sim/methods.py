"""Frequency assignments ("methods") compared on the simulator.

Each method maps the job's situation to a clock for every computation of one pipeline:
``target_s`` is ``None`` without a straggler (the replica's iteration is its own), or the
straggler's iteration time ``T'`` that the replica has to wait for anyway.

- ``max``: every GPU at its highest clock (what runs without any of these tools).
- ``perseus-instruction``: the Perseus frontier point at ``T_min``; behind a straggler
  ``choose_point(frontier, target_s=T')``, the least energy including blocking until ``T'``
  (the slowest point that ends by ``T'``; ``T_max`` when ``T'`` is past it), moved to the next
  faster frontier points while its measured time (real, not floor-quantized, computation times)
  would exceed ``T'``.
- ``perseus-stage``: the plan's one clock per stage (``PipelinePlan.stages[s].frequency_mhz``)
  for the same choices.
- ``zeus-global``: one clock for every GPU (ZeusGlobal-like): the clock of least energy, blocking
  included up to the job's iteration time, among those whose iteration time stays within it.
  Without a straggler that deadline is the all-max iteration time, so it picks the max clock
  unless a lower one is exactly as fast; behind a straggler the deadline is ``T'``.
- ``zeus-per-stage``: ZeusPerStage-like balancing: each stage takes, among the clocks whose
  stage compute time (its forwards and backwards summed) does not exceed the slowest stage's at
  max clock (scaled by ``T' / T_allmax`` behind a straggler), the one of least effective energy
  (energy minus blocking power over its time: what a GPU saves by computing instead of
  waiting); on monotone profiles that is the lowest such clock.
- ``envpipe``: EnvPipe's outer-envelope heuristic as read from its paper (Ryu et al., ATC'23):
  in 1F1B the iteration time is set by the "outer envelope" of the schedule (the warm-up
  forwards down the pipeline, the last stage, the cool-down backwards up it); those
  computations keep the max clock and every other computation is slowed as far as its slack
  allows without lengthening the iteration. Reimplemented here as: at max clocks, visit
  computations in reverse topological order and give each the clock of least effective
  energy that leaves the iteration time unchanged; computations on the critical path (the
  envelope) have no slack and stay at max. EnvPipe does not react to stragglers: the same
  assignment is used behind one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from perseus_api.plan import Granularity
from perseus_planner.errors import PlannerError
from perseus_planner.frontier import Baseline, Frontier
from perseus_planner.plan import Choice, build_plan, choose_point
from perseus_planner.sim.engine import (
    ClockTable,
    IntArray,
    PipelineGraph,
    clock_table,
    makespans_s,
    measure_assignments,
    pipeline_graph,
)

_TIME_TOLERANCE = 1e-9
"""Relative: longest-path sums of the same durations in another order may differ this much."""


@dataclass(frozen=True)
class SimSetup:
    """A solved pipeline and its simulation tables."""

    frontier: Frontier
    baseline: Baseline
    graph: PipelineGraph
    table: ClockTable

    @property
    def blocking_power_w(self) -> float:
        return self.frontier.problem.blocking_power_w

    @property
    def num_stages(self) -> int:
        return self.frontier.problem.num_stages

    def all_max_time_s(self) -> float:
        return self.baseline.time_s


def sim_setup(frontier: Frontier, baseline: Baseline) -> SimSetup:
    """Prepare the simulator for ``frontier``'s pipeline and profile."""
    problem = frontier.problem
    return SimSetup(
        frontier, baseline, pipeline_graph(problem.dag), clock_table(problem.profile, problem.dag)
    )


Method = Callable[[SimSetup, "float | None"], IntArray]


def all_max(setup: SimSetup, target_s: float | None) -> IntArray:
    del target_s  # the max clock whatever the situation
    return setup.table.max_frequencies_mhz()


def _perseus_choice(setup: SimSetup, target_s: float | None) -> Choice:
    """``choose_point``, moved to faster points until the *measured* time fits ``target_s``.

    The planner floors every computation's time to its unit, so a point's real iteration
    time is a little longer than its frontier time (GPT-3 A100: ~0.1 %). Behind a straggler
    that would make the healthy replicas the slowest ones; the next faster points fix that.
    """
    frontier = setup.frontier
    choice = choose_point(frontier, target_s=target_s)
    if target_s is None:
        return choice
    index = choice.index
    while index < frontier.t_min_index:
        (run,) = measure_assignments(setup.graph, setup.table, [frontier.frequencies_at(index)])
        if run.time_s <= target_s * (1 + _TIME_TOLERANCE):
            break
        index += 1
    return replace(choice, index=index)


def perseus_instruction(setup: SimSetup, target_s: float | None) -> IntArray:
    return setup.frontier.frequencies_at(_perseus_choice(setup, target_s).index)


def perseus_stage(setup: SimSetup, target_s: float | None) -> IntArray:
    choice = _perseus_choice(setup, target_s)
    plan = build_plan(setup.frontier, setup.baseline, choice, Granularity.STAGE)
    per_stage = np.array([s.frequency_mhz for s in plan.stages], dtype=np.int64)
    clocks: IntArray = per_stage[setup.graph.node_stage]
    return clocks


def _common_clocks(setup: SimSetup) -> IntArray:
    """Clocks profiled for every computation, highest first."""
    common = set(setup.table.frequencies_mhz[0].tolist())
    for freqs in setup.table.frequencies_mhz[1:]:
        common &= set(freqs.tolist())
    if not common:
        raise PlannerError("no clock is profiled for every computation")
    return np.array(sorted(common, reverse=True), dtype=np.int64)


def zeus_global(setup: SimSetup, target_s: float | None) -> IntArray:
    clocks = _common_clocks(setup)
    n = setup.graph.num_nodes
    runs = measure_assignments(
        setup.graph, setup.table, [np.full(n, f, dtype=np.int64) for f in clocks.tolist()]
    )
    deadline_s = setup.all_max_time_s() if target_s is None else max(target_s, runs[0].time_s)
    p_w, gpus = setup.blocking_power_w, setup.num_stages
    best = min(
        (r for r in runs if r.time_s <= deadline_s * (1 + _TIME_TOLERANCE)),
        key=lambda r: r.busy_energy_j + p_w * (gpus * deadline_s - r.busy_time_s),
    )
    return best.frequencies_mhz


def zeus_per_stage(setup: SimSetup, target_s: float | None) -> IntArray:
    graph, table = setup.graph, setup.table
    clocks = _common_clocks(setup)
    stage_time_s = np.zeros((len(clocks), graph.num_stages))
    stage_cost_j = np.zeros((len(clocks), graph.num_stages))
    for k, f in enumerate(clocks.tolist()):
        t, e = table.measure(np.full(graph.num_nodes, f, dtype=np.int64))
        np.add.at(stage_time_s[k], graph.node_stage, t)
        np.add.at(stage_cost_j[k], graph.node_stage, e - setup.blocking_power_w * t)
    stretch = 1.0 if target_s is None else max(1.0, target_s / setup.all_max_time_s())
    limit_s = stage_time_s[0].max() * stretch * (1 + _TIME_TOLERANCE)
    cost = np.where(stage_time_s <= limit_s, stage_cost_j, np.inf)
    picks = np.argmin(cost, axis=0)  # row 0 (max clock) always fits for the slowest stage
    per_stage = clocks[picks]
    result: IntArray = per_stage[graph.node_stage]
    return result


def envpipe(setup: SimSetup, target_s: float | None) -> IntArray:
    del target_s  # EnvPipe plans for its own schedule only
    graph, table = setup.graph, setup.table
    p_w = setup.blocking_power_w
    freqs = table.max_frequencies_mhz()
    times, _ = table.measure(freqs)
    limit_s = float(makespans_s(graph, times)[0]) * (1 + _TIME_TOLERANCE)
    for nodes in reversed(graph.levels):
        for v in nodes.tolist():
            options_t = table.times_s[v]
            effective = table.energies_j[v] - p_w * options_t
            trial = np.repeat(times[None, :], len(options_t), axis=0)
            trial[:, v] = options_t
            fits = makespans_s(graph, trial) <= limit_s
            k = int(np.argmin(np.where(fits, effective, np.inf)))
            freqs[v] = table.frequencies_mhz[v][k]
            times[v] = options_t[k]
    return freqs


STRAGGLER_BLIND = frozenset({"max", "envpipe"})
"""Methods whose clocks do not depend on the straggler: planned once, whatever ``target_s``."""

METHODS: dict[str, Method] = {
    "max": all_max,
    "perseus-instruction": perseus_instruction,
    "perseus-stage": perseus_stage,
    "zeus-global": zeus_global,
    "zeus-per-stage": zeus_per_stage,
    "envpipe": envpipe,
}
"""Every method by the name the CLI and reports use."""
