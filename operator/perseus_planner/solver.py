"""Iteration time–energy frontier of a pipeline, by Phillips–Dessouky steps.

Start with every computation at its slowest option (the longest iteration,
``T_max``), then repeatedly shorten the iteration by one time unit at the
least increase in energy: find the minimum cut of the critical DAG whose arcs
carry the marginal cost of speeding a computation up (upper bound) and the
saving of slowing it down (lower bound), speed up the computations crossing the
cut forward and slow down those crossing it backward. Each step is one point of
the frontier, until a step would have to shorten something that cannot be
(``T_min``).

Each step starts from the previous step's maximum flow, minimum cut and critical
DAG, which the small change between steps leaves almost intact
(:mod:`perseus_planner._kept_cut`); the minimum cut read from them is the one a
flow built from zero gives (:mod:`perseus_planner._steps` keeps that reference
for comparison).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from perseus_api.profile import Profile
from perseus_planner import _kept_cut, _kernel, _steps
from perseus_planner._tables import KernelTables
from perseus_planner.cost_model import CostModel, fit_cost_model
from perseus_planner.dag import PipelineDAG, topological_order
from perseus_planner.errors import SolverError
from perseus_planner.options import ExecutionOptions, build_options

CAPACITY_QUANTUM_J = 1e-6
"""Capacities are rounded down to this, as in the artifact (the kernel works in these units)."""

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ComputationModel:
    """Options and fitted cost model shared by all computations of one (stage, instruction)."""

    stage: int
    instruction: str
    options: ExecutionOptions
    cost_model: CostModel


@dataclass(frozen=True)
class FrontierProblem:
    """Everything the solver needs, validated up front.

    Attributes:
        profile: The measurements everything was derived from.
        dag: The computation DAG.
        models: Per (stage, instruction) options and cost model.
        unit_time_s: Time quantum of one solver step.
        blocking_power_w: Power of one GPU while it waits on communication.
    """

    profile: Profile
    dag: PipelineDAG
    models: dict[tuple[int, str], ComputationModel]
    unit_time_s: float
    blocking_power_w: float
    _tables: KernelTables = field(repr=False)

    @property
    def num_stages(self) -> int:
        return self.dag.num_stages

    def energy_j(self, cost_j: float, time_s: float) -> float:
        """Energy of one iteration: effective computation energy plus blocking for all GPUs."""
        return cost_j + self.num_stages * time_s * self.blocking_power_w

    def frequencies_mhz(self, quant_durations: IntArray) -> IntArray:
        """Clock of every computation for the given durations."""
        t = self._tables
        n = self.dag.num_nodes
        knobs: IntArray = t.knob_tab[t.tab_off[:n] + quant_durations - t.dmin[:n]]
        return knobs

    def cost_j(self, quant_durations: IntArray) -> float:
        """Total effective energy (fitted) of the given durations."""
        t = self._tables
        n = self.dag.num_nodes
        return float(t.cost_tab[t.tab_off[:n] + quant_durations - t.dmin[:n]].sum())

    def makespan(self, quant_durations: IntArray) -> int:
        """Iteration time, in time units, of the given durations."""
        t = self._tables
        dur = np.zeros(self.dag.num_nodes + 2, dtype=np.int64)
        dur[: self.dag.num_nodes] = quant_durations
        ef = np.empty_like(dur)
        ls = np.empty_like(dur)
        return int(_kernel.critical_path(*t.graph, dur, ef, ls))

    def real_makespan_s(self, times_s: FloatArray) -> float:
        """Iteration time for unquantized computation times (seconds, by node index)."""
        topo, pred_ptr, pred_idx, _, _ = self._tables.graph
        n = self.dag.num_nodes
        finish = np.zeros(n + 2, dtype=np.float64)
        for v in topo.tolist():
            start = max((finish[u] for u in pred_idx[pred_ptr[v] : pred_ptr[v + 1]]), default=0.0)
            finish[v] = start + (times_s[v] if v < n else 0.0)
        return float(finish.max())

    @property
    def slowest_durations(self) -> IntArray:
        return self._tables.dmax[: self.dag.num_nodes].copy()

    @property
    def fastest_durations(self) -> IntArray:
        return self._tables.dmin[: self.dag.num_nodes].copy()


@dataclass(frozen=True)
class FrontierPoint:
    """One point of the frontier.

    Attributes:
        iteration: 0 for the starting point (``T_max``), then one per step.
        quant_time: Iteration time in time units.
        time_s: Iteration time of one pipeline (``quant_time * unit_time_s``).
        cost_j: Effective computation energy (blocking power excluded).
        energy_j: Energy of one iteration of the pipeline, blocking energy included.
        quant_durations: Duration of every computation (time units), by node index.
        frequencies_mhz: Clock of every computation, by node index.
        sped_up: Nodes made one unit faster by this step.
        slowed_down: Nodes made one unit slower by this step.
    """

    iteration: int
    quant_time: int
    time_s: float
    cost_j: float
    energy_j: float
    quant_durations: IntArray
    frequencies_mhz: IntArray
    sped_up: IntArray
    slowed_down: IntArray


def build_problem(
    profile: Profile, dag: PipelineDAG, unit_time_s: float, blocking_power_w: float
) -> FrontierProblem:
    """Prepare options, cost models and kernel tables.

    Raises:
        SolverError: The profile has fewer stages than the DAG, or options are unusable.
        CostModelError: A computation's options cannot be fit.
    """
    if profile.num_stages != dag.num_stages:
        raise SolverError(
            f"the profile {profile.source} has {profile.num_stages} stages but the pipeline "
            f"has {dag.num_stages}; profile every stage"
        )
    models: dict[tuple[int, str], ComputationModel] = {}
    for comp in dag.computations:
        key = (comp.stage, comp.instruction)
        if key not in models:
            options = build_options(profile.get(*key), unit_time_s, blocking_power_w)
            model = fit_cost_model(
                options.quant_times, options.costs_j, unit_time_s, f"stage {key[0]} {key[1]}"
            )
            models[key] = ComputationModel(comp.stage, comp.instruction, options, model)
    tables = _build_tables(dag, models)
    return FrontierProblem(profile, dag, models, unit_time_s, blocking_power_w, tables)


def _build_tables(
    dag: PipelineDAG, models: dict[tuple[int, str], ComputationModel]
) -> KernelTables:
    n = dag.num_nodes
    src, snk = n, n + 1
    edges = [tuple(e) for e in dag.edges.tolist()]
    indeg = np.bincount(dag.edges[:, 1], minlength=n) if len(edges) else np.zeros(n, np.int64)
    outdeg = np.bincount(dag.edges[:, 0], minlength=n) if len(edges) else np.zeros(n, np.int64)
    edges += [(src, v) for v in range(n) if indeg[v] == 0]
    edges += [(u, snk) for u in range(n) if outdeg[u] == 0]
    all_edges = np.asarray(edges, dtype=np.int64)
    num = n + 2
    topo = topological_order(num, all_edges)

    def csr(keys: IntArray, values: IntArray) -> tuple[IntArray, IntArray]:
        order = np.argsort(keys, kind="stable")
        ptr = np.zeros(num + 1, dtype=np.int64)
        np.cumsum(np.bincount(keys, minlength=num), out=ptr[1:])
        return ptr, values[order].astype(np.int64)

    pred_ptr, pred_idx = csr(all_edges[:, 1], all_edges[:, 0])
    succ_ptr, succ_idx = csr(all_edges[:, 0], all_edges[:, 1])

    # Per (stage, instruction) tables over every duration in [min, max].
    spec_off: dict[tuple[int, str], int] = {}
    cost_parts: list[FloatArray] = []
    lb_parts: list[IntArray] = []
    ub_parts: list[IntArray] = []
    knob_parts: list[IntArray] = []
    offset = 0
    for key, m in models.items():
        q = np.arange(m.options.min_quant_time, m.options.max_quant_time + 1, dtype=np.int64)
        cost = m.cost_model(q)
        lb, ub = _bounds(cost)
        spec_off[key] = offset
        offset += len(q)
        cost_parts.append(cost)
        lb_parts.append(lb)
        ub_parts.append(ub)
        knob_parts.append(np.array([m.options.frequency_for(int(d)) for d in q], np.int64))

    dmin = np.zeros(num, dtype=np.int64)
    dmax = np.zeros(num, dtype=np.int64)
    tab_off = np.zeros(num, dtype=np.int64)
    for i, comp in enumerate(dag.computations):
        key = (comp.stage, comp.instruction)
        dmin[i] = models[key].options.min_quant_time
        dmax[i] = models[key].options.max_quant_time
        tab_off[i] = spec_off[key]
    dummy = np.zeros(num, dtype=np.bool_)
    dummy[src] = dummy[snk] = True
    return KernelTables(
        graph=(topo, pred_ptr, pred_idx, succ_ptr, succ_idx),
        edge_u=all_edges[:, 0].copy(),
        edge_v=all_edges[:, 1].copy(),
        dummy=dummy,
        dmin=dmin,
        dmax=dmax,
        tab_off=tab_off,
        cost_tab=np.concatenate(cost_parts),
        lb_tab=np.concatenate(lb_parts),
        ub_tab=np.concatenate(ub_parts),
        knob_tab=np.concatenate(knob_parts),
    )


def _bounds(cost: FloatArray) -> tuple[IntArray, IntArray]:
    """Flow bounds (micro-joules) of a computation at each duration.

    Lower bound: saving of slowing down by one unit; upper bound: cost of
    speeding up by one unit (with one quantum of slack where both are possible,
    so that almost-linear cost models still leave room for flow). Computations
    that cannot be sped up get an infinite upper bound and cannot be cut.
    """
    size = len(cost)
    lb = np.zeros(size, dtype=np.int64)
    ub = np.full(size, _kernel.INF_UNITS, dtype=np.int64)
    if size == 1:
        return lb, ub
    slower_saving = np.abs(cost[:-1] - cost[1:])  # at duration index k: c(k) - c(k+1)
    lb[:-1] = np.floor_divide(slower_saving, CAPACITY_QUANTUM_J).astype(np.int64)
    faster_cost = slower_saving  # at index k: c(k-1) - c(k) == slower_saving[k-1]
    ub[-1] = int(faster_cost[-1] // CAPACITY_QUANTUM_J)
    ub[1:-1] = np.floor_divide(faster_cost[:-1] + CAPACITY_QUANTUM_J, CAPACITY_QUANTUM_J).astype(
        np.int64
    )
    return lb, ub


def iterate_frontier(
    problem: FrontierProblem, *, keep_flow: bool = True
) -> Iterator[FrontierPoint]:
    """Yield the frontier from ``T_max`` down to ``T_min``, one time unit per point.

    Args:
        problem: The prepared problem.
        keep_flow: Start each step from the previous step's maximum flow and cut
            (:mod:`perseus_planner._kept_cut`). ``False`` rebuilds the flow from zero
            every step, the reference the tests compare with; both give the
            same frontier.
    """
    n = problem.dag.num_nodes
    for step in iterate_steps(problem, keep_flow=keep_flow):
        yield frontier_point(
            problem, step.iteration, step.quant_time, step.cost_j, step.durations[:n],
            step.sped_up, step.slowed_down,
        )  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One point of the frontier as the solver finds it, before any per-computation table.

    ``durations`` is the solver's own array (all nodes, source and sink last): it
    holds this point's durations only until the iterator moves on.
    """

    iteration: int
    quant_time: int
    cost_j: float
    sped_up: IntArray
    slowed_down: IntArray
    durations: IntArray


def iterate_steps(
    problem: FrontierProblem, *, keep_flow: bool = True, totals: bool = True
) -> Iterator[Step]:
    """What :func:`iterate_frontier` yields, without the per-point copies and clock tables.

    Those cost a pass over every computation per point, as much as a step on
    large pipelines; :func:`perseus_planner.frontier.compute_frontier` keeps only
    what changes. With ``totals=False`` (and ``keep_flow``) the steps after the
    first leave ``cost_j`` NaN, for :func:`perseus_planner._costs.point_costs`.
    """
    t = problem._tables
    n = problem.dag.num_nodes
    num = n + 2
    dur = t.dmax.copy()
    dur[n:] = 0
    ef = np.empty(num, dtype=np.int64)
    ls = np.empty(num, dtype=np.int64)
    makespan = int(_kernel.critical_path(*t.graph, dur, ef, ls))
    empty = np.empty(0, dtype=np.int64)
    yield Step(0, makespan, problem.cost_j(dur[:n]), empty, empty, dur)
    stepper: _steps.WarmStepper | _steps.ReferenceStepper
    if keep_flow:
        stepper = _steps.WarmStepper(t, dur, ef, ls)
        stepper.kc[_kept_cut.NO_TOTAL] = 0 if totals else 1
    else:
        stepper = _steps.ReferenceStepper(t, dur, ef, ls)
    step = stepper.step
    changed_up = np.empty(num, dtype=np.int64)
    changed_down = np.empty(num, dtype=np.int64)
    out_i = np.zeros(4, dtype=np.int64)
    out_f = np.zeros(2, dtype=np.float64)
    iteration = 0
    while True:
        step(changed_up, changed_down, out_i, out_f)
        if out_i[0] != _kernel.STATUS_OK:
            return
        iteration += 1
        yield Step(
            iteration,
            int(out_i[1]),
            float(out_f[1]),
            changed_up[: out_i[2]].copy(),
            changed_down[: out_i[3]].copy(),
            dur,
        )


def frontier_point(
    problem: FrontierProblem,
    iteration: int,
    quant_time: int,
    cost_j: float,
    dur: IntArray,
    sped_up: IntArray,
    slowed_down: IntArray,
) -> FrontierPoint:
    """The point with these values; copies ``dur`` (the solver's array moves on)."""
    time_s = quant_time * problem.unit_time_s
    durations = dur.copy()
    return FrontierPoint(
        iteration=iteration,
        quant_time=quant_time,
        time_s=time_s,
        cost_j=cost_j,
        energy_j=problem.energy_j(cost_j, time_s),
        quant_durations=durations,
        frequencies_mhz=problem.frequencies_mhz(durations),
        sped_up=sped_up,
        slowed_down=slowed_down,
    )
