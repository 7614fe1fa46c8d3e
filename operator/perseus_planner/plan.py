"""Choosing a point of the frontier and turning it into per-GPU clocks.

- ``T_min`` (intrinsic bloat only): the fastest point; no slowdown.
- Straggler at ``T'``: the replicas that wait for it anyway run the point with
  ``T <= T'`` that uses the least energy *including* blocking power while they
  wait from ``T`` until ``T'``. A ``T'`` below ``T_min`` cannot be met: the plan
  runs at ``T_min`` and records ``T_min`` as its target (``Choice.requested_target_s``
  keeps what was asked, for a warning).
- Slowdown budget ``x``: the least-energy point with ``T <= (1 + x) * T_min``.

``Instruction`` granularity applies the point as is. ``Stage`` granularity can
lock only one clock per GPU, so it gets its own search: per-stage clocks that
keep the iteration within the chosen point's time at the least energy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_api.plan import (
    Granularity,
    InstructionClock,
    PipelinePlan,
    PlanEstimate,
    PlanObjective,
    StagePlan,
)
from perseus_planner.errors import LimitError, PlannerError
from perseus_planner.frontier import Baseline, Frontier
from perseus_planner.limits import MAX_QUANT_UNITS, check_target
from perseus_planner.solver import FrontierProblem

IntArray = npt.NDArray[np.int64]

_MAX_COORDINATE_PASSES = 20


@dataclass(frozen=True)
class Choice:
    """A chosen frontier point and why.

    Attributes:
        index: The frontier point.
        objective: What it was chosen for.
        target_s: The iteration time it aims at (``T'``, or the slowdown deadline), as
            achieved: a straggler target below ``T_min`` cannot be met and becomes ``T_min``.
        requested_target_s: The straggler target asked for, when it differs from
            ``target_s`` (callers warn about it).
    """

    index: int
    objective: PlanObjective
    target_s: float | None
    requested_target_s: float | None = None

    @property
    def target_unreachable(self) -> bool:
        """Whether the requested straggler target was faster than ``T_min``."""
        return self.requested_target_s is not None


def choose_point(
    frontier: Frontier, *, target_s: float | None = None, max_slowdown: float | None = None
) -> Choice:
    """Pick the frontier point for a straggler target or a slowdown budget (else ``T_min``).

    Raises:
        PlannerError: Both or invalid targets.
    """
    if target_s is not None and max_slowdown is not None:
        raise PlannerError("give either a straggler target or a max slowdown, not both")
    times = frontier.times_s
    if target_s is not None:
        check_target(target_s, frontier.problem.unit_time_s)
        feasible = times <= target_s
        if not feasible.any():
            # The "straggler" is faster than this pipeline can be: run flat out, and record
            # the time achieved rather than one no plan meets (savings are compared there).
            t_min_s = float(times[frontier.t_min_index])
            return Choice(frontier.t_min_index, PlanObjective.STRAGGLER, t_min_s, target_s)
        p = frontier.problem
        waiting_j = p.num_stages * p.blocking_power_w * (target_s - times)
        total = np.where(feasible, frontier.energies_j + waiting_j, np.inf)
        return Choice(int(np.argmin(total)), PlanObjective.STRAGGLER, target_s)
    if max_slowdown is not None:
        if not (np.isfinite(max_slowdown) and max_slowdown >= 0):
            raise PlannerError(f"max slowdown must be a fraction >= 0, got {max_slowdown}")
        deadline = float(times[frontier.t_min_index]) * (1 + max_slowdown)
        if not deadline / frontier.problem.unit_time_s <= MAX_QUANT_UNITS:
            raise LimitError(
                f"max slowdown {max_slowdown:g} puts the deadline beyond 2**53 time units of "
                f"{frontier.problem.unit_time_s:g} s; any slowdown above "
                f"{float(times[0] / times[frontier.t_min_index]) - 1:.4g} allows T_max already"
            )
        candidates = np.where(times <= deadline, frontier.energies_j, np.inf)
        return Choice(int(np.argmin(candidates)), PlanObjective.MAX_SLOWDOWN, deadline)
    return Choice(frontier.t_min_index, PlanObjective.MIN_TIME, None)


@dataclass(frozen=True)
class StageClocks:
    """Result of the stage-granularity search."""

    frequencies_mhz: IntArray  # per stage
    time_s: float  # quantized iteration time
    energy_j: float  # over time_s, blocking included


class _StageModel:
    """Measured time and energy of every computation for one clock per stage."""

    def __init__(self, problem: FrontierProblem) -> None:
        self.problem = problem
        dag = problem.dag
        unit = problem.unit_time_s
        self.choices: list[IntArray] = []
        self.quant: list[IntArray] = []  # per stage: (num_choices, nodes_in_stage)
        self.times: list[npt.NDArray[np.float64]] = []
        self.energies: list[npt.NDArray[np.float64]] = []
        self.nodes: list[IntArray] = []
        self.busy_j: list[list[float]] = []  # per stage, per clock: its computations' energy
        self.busy_s: list[list[float]] = []  # and time
        self._evaluated: dict[tuple[int, ...], tuple[int, float, float]] = {}
        for stage, order in enumerate(dag.stage_order):
            # Every model stage and instruction this GPU runs (several with virtual stages or
            # a split backward) must be profiled at the clock it is locked to.
            keys = [(dag.computations[i].stage, dag.computations[i].instruction) for i in order]
            measured = {k: problem.profile.get(*k) for k in dict.fromkeys(keys)}
            common = sorted(
                set.intersection(*(set(m.frequencies_mhz.tolist()) for m in measured.values())),
                reverse=True,
            )
            if not common:
                raise PlannerError(f"stage {stage}: its computations share no profiled clock")
            freqs = np.asarray(common, dtype=np.int64)
            nodes = np.asarray(order, dtype=np.int64)
            t = np.empty((len(freqs), len(nodes)))
            e = np.empty((len(freqs), len(nodes)))
            for key, m in measured.items():
                columns = [j for j, k in enumerate(keys) if k == key]
                rows = [int(np.nonzero(m.frequencies_mhz == f)[0][0]) for f in freqs.tolist()]
                t[:, columns] = m.times_s[rows][:, None]
                e[:, columns] = m.energies_j[rows][:, None]
            self.choices.append(freqs)
            self.nodes.append(nodes)
            self.times.append(t)
            self.energies.append(e)
            self.quant.append(np.floor_divide(t, unit).astype(np.int64))
            # Each clock's sums, once: evaluate() runs thousands of times per plan (the
            # coordinate descent), and these sums were most of its time. Summed row by row
            # as evaluate() did, so every float is the same.
            self.busy_j.append([float(row.sum()) for row in e])
            self.busy_s.append([float(row.sum()) for row in t])

    def evaluate(self, picks: list[int], until_quant: int = 0) -> tuple[int, float]:
        """Quantized makespan and energy (blocking included, until the makespan or
        ``until_quant``, whichever is later) for clock index per stage."""
        p = self.problem
        key = tuple(picks)
        known = self._evaluated.get(key)
        if known is None:
            # The descents try the same picks again and again (each pass, each start, each
            # guide): the critical path of each is computed once.
            dur = np.empty(p.dag.num_nodes, dtype=np.int64)
            busy_j = 0.0
            busy_s = 0.0
            for s, k in enumerate(picks):
                dur[self.nodes[s]] = self.quant[s][k]
                busy_j += self.busy_j[s][k]
                busy_s += self.busy_s[s][k]
            known = self._evaluated[key] = (p.makespan(dur), busy_j, busy_s)
        makespan, busy_j, busy_s = known
        time_s = max(makespan, until_quant) * p.unit_time_s
        return makespan, busy_j + p.blocking_power_w * (p.num_stages * time_s - busy_s)


def _uniform_start(model: _StageModel, deadline_quant: int) -> list[int]:
    """Every stage slowed by as many clock steps as the deadline allows, all together.

    One stage slowed alone becomes the pipeline's bottleneck and uses up the slack that all
    of them could share, so descent from the highest clocks stops short when there is much
    slack (behind a straggler); from here it starts with the slack spread over every stage.
    """
    longest = max(len(c) for c in model.choices)

    def picks(step: int) -> list[int]:
        return [min(step, len(c) - 1) for c in model.choices]

    low, high = 0, longest - 1  # the fastest always fits when anything does
    while low < high:
        mid = (low + high + 1) // 2
        if model.evaluate(picks(mid))[0] <= deadline_quant:
            low = mid
        else:
            high = mid - 1
    return picks(low)


def stage_clocks(
    problem: FrontierProblem,
    deadline_quant: int,
    start_mhz: IntArray | None = None,
    *,
    waits_for_deadline: bool = False,
) -> StageClocks:
    """Per-stage clocks with the least energy whose iteration fits in ``deadline_quant``.

    Coordinate descent over stages from the highest clocks (and from ``start_mhz``
    if given, keeping the better result): each stage in turn takes its
    least-energy clock that keeps the iteration within the deadline.

    ``waits_for_deadline``: the iteration lasts until the deadline whatever the clocks (a
    straggler's ``T'``), so candidates are compared by their energy until then: one that
    finishes earlier waits at blocking power. Otherwise each is compared over its own
    iteration time, and a slower one pays for the longer blocking, which behind a straggler
    would keep every stage fast for nothing.
    """
    model = _StageModel(problem)
    starts = [[0] * problem.num_stages, _uniform_start(model, deadline_quant)]
    if start_mhz is not None:
        starts.append(
            [int(np.argmin(np.abs(c - f))) for c, f in zip(model.choices, start_mhz, strict=True)]
        )
    until_quant = deadline_quant if waits_for_deadline else 0
    # Greedy descent finds local optima only; descending by the energy over the plan's own
    # iteration as well reaches others, which the final choice compares by the right measure.
    guides = {0, until_quant}
    found = [_descend(model, start, deadline_quant, guide) for start in starts for guide in guides]
    picks = min(found, key=lambda p: model.evaluate(p, until_quant)[1])
    makespan, own_energy_j = model.evaluate(picks)  # over its own iteration, as StageClocks says
    freqs = np.array([model.choices[s][k] for s, k in enumerate(picks)], dtype=np.int64)
    return StageClocks(freqs, makespan * problem.unit_time_s, own_energy_j)


def _descend(
    model: _StageModel, picks: list[int], deadline_quant: int, until_quant: int
) -> list[int]:
    """Coordinate descent from ``picks``: each stage in turn takes the clock of least energy
    (blocking until ``until_quant`` or the makespan) that keeps the iteration in the deadline;
    until no stage changes. Starts from the highest clocks if ``picks`` does not fit."""
    makespan, energy = model.evaluate(picks, until_quant)
    if makespan > deadline_quant:
        picks = [0] * len(picks)
        makespan, energy = model.evaluate(picks, until_quant)
    for _ in range(_MAX_COORDINATE_PASSES):
        improved = False
        for s in range(len(picks)):
            for k in range(len(model.choices[s])):
                if k == picks[s]:
                    continue
                trial = [*picks[:s], k, *picks[s + 1 :]]
                m, e = model.evaluate(trial, until_quant)
                if m <= max(deadline_quant, makespan) and e < energy - 1e-9:
                    picks, makespan, energy, improved = trial, m, e, True
        if not improved:
            break
    return picks


def build_plan(
    frontier: Frontier, baseline: Baseline, choice: Choice, granularity: Granularity
) -> PipelinePlan:
    """Per-GPU plan for the chosen point, with estimates for both granularities."""
    problem = frontier.problem
    dag = problem.dag
    index = choice.index
    freqs = frontier.frequencies_at(index)
    per_stage_max = np.array([freqs[list(order)].max() for order in dag.stage_order])
    deadline_quant = int(frontier.quant_times[index])
    behind_straggler = choice.objective is PlanObjective.STRAGGLER and choice.target_s is not None
    if behind_straggler:
        # One clock per stage cannot follow the frontier point exactly: let it use all of T'.
        assert choice.target_s is not None
        deadline_quant = max(deadline_quant, int(choice.target_s // problem.unit_time_s))
    clocks = stage_clocks(
        problem, deadline_quant, per_stage_max, waits_for_deadline=behind_straggler
    )
    stage_of_node = np.empty(dag.num_nodes, dtype=np.int64)
    for s, order in enumerate(dag.stage_order):
        stage_of_node[list(order)] = s
    stages = [
        StagePlan(
            stage=s,
            frequency_mhz=int(clocks.frequencies_mhz[s]),
            instructions=[
                InstructionClock(
                    instruction=dag.computations[i].instruction,
                    microbatch=dag.computations[i].microbatch,
                    frequency_mhz=int(freqs[i]),
                    virtual_stage=dag.computations[i].stage if dag.virtual_stages > 1 else None,
                )
                for i in order
            ],
        )
        for s, order in enumerate(dag.stage_order)
    ]
    return PipelinePlan(
        schedule=dag.schedule.value,
        num_stages=dag.num_stages,
        num_microbatches=dag.num_microbatches,
        virtual_stages=dag.virtual_stages,
        granularity=granularity,
        objective=choice.objective,
        target_iteration_time_s=choice.target_s,
        unit_time_s=problem.unit_time_s,
        blocking_power_w=problem.blocking_power_w,
        t_min_s=float(frontier.times_s[frontier.t_min_index]),
        t_star_s=float(frontier.times_s[frontier.t_star_index]),
        baseline_iteration_time_s=baseline.time_s,
        instruction_estimate=_estimate(
            problem, baseline, choice, float(frontier.times_s[index]), freqs
        ),
        stage_estimate=_estimate(
            problem, baseline, choice, clocks.time_s, clocks.frequencies_mhz[stage_of_node]
        ),
        stages=stages,
    )


def _estimate(
    problem: FrontierProblem,
    baseline: Baseline,
    choice: Choice,
    planned_time_s: float,
    frequencies_mhz: IntArray,
) -> PlanEstimate:
    """The planned iteration time (quantized, as targets and slowdown budgets are met), and the
    energy and savings of the plan's clocks (one per computation) replayed on the profile's own
    rows, compared with the all-max baseline at the replayed iteration time.

    Not the frontier point's fitted energy: the exponential fits that make the search convex
    are off the measured rows by a few percent, and that error lands whole on the savings
    (5.67 % fitted vs 5.17 % on the rows for the e2e's plan, which emulated GPUs following
    the rows realize). The baseline is measured the same way (:func:`max_frequency_baseline`).
    Behind a straggler every replica's iteration lasts ``T'``: a plan that finishes earlier
    waits at blocking power, and so would the all-max baseline.
    """
    dag = problem.dag
    times_s = np.empty(dag.num_nodes, dtype=np.float64)
    energies_j = np.empty(dag.num_nodes, dtype=np.float64)
    for i, comp in enumerate(dag.computations):
        m = problem.profile.get(comp.stage, comp.instruction)
        row = int(np.flatnonzero(m.frequencies_mhz == frequencies_mhz[i])[0])
        times_s[i], energies_j[i] = m.times_s[row], m.energies_j[row]
    time_s = problem.real_makespan_s(times_s)
    effective_s = time_s
    if choice.objective is PlanObjective.STRAGGLER and choice.target_s is not None:
        effective_s = max(time_s, choice.target_s)
    blocking_s = problem.num_stages * effective_s - float(times_s.sum())
    total_j = float(energies_j.sum()) + problem.blocking_power_w * blocking_s
    return PlanEstimate(
        iteration_time_s=planned_time_s,
        energy_j=total_j,
        savings_ratio=baseline.savings_ratio(total_j, effective_s),
    )
