"""Discrete-event simulation of data-parallel x pipeline-parallel training iterations.

A pipeline schedule is static: every stage runs its computations in a fixed order and each
one starts as soon as its predecessors (its stage's previous computation, the same
microbatch on the neighbouring stage) are done. So the event order never depends on
durations, and one iteration of one pipeline is a longest-path pass over the DAG: no event
heap. Nodes are grouped into levels (longest hop count from a source) once; each level is
then one vectorized step over every pipeline being simulated at once.

Energy accounting (the same as the planner's and the Perseus paper's): a GPU computing
draws the profile's measured energy for that computation; a GPU not computing (waiting on
a pipeline dependency, or at the gradient synchronization that ends every iteration of every
replica when the slowest replica ends) draws ``blocking_power_w``. The all-reduce itself is
not modelled: it takes the same time for every method, so it shifts all iteration times
and energies alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_api.profile import Profile
from perseus_planner.dag import PipelineDAG, topological_order
from perseus_planner.errors import PlannerError

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class PipelineGraph:
    """The DAG prepared for vectorized longest-path passes.

    Attributes:
        num_nodes: Computations per iteration of one pipeline.
        num_stages: GPUs per pipeline.
        levels: Node indices of each level, in level order.
        preds: ``(num_nodes, max_indegree)`` predecessors, padded with ``num_nodes``
            (a virtual node that always finishes at time 0).
        node_stage: Stage of every node.
    """

    num_nodes: int
    num_stages: int
    levels: tuple[IntArray, ...]
    preds: IntArray
    node_stage: IntArray


def pipeline_graph(dag: PipelineDAG) -> PipelineGraph:
    """Levels and padded predecessor table of ``dag``."""
    n = dag.num_nodes
    edges = dag.edges
    pred_lists: list[list[int]] = [[] for _ in range(n)]
    for u, v in edges.tolist():
        pred_lists[v].append(u)
    depth = np.zeros(n, dtype=np.int64)
    for v in topological_order(n, edges).tolist():
        if pred_lists[v]:
            depth[v] = 1 + max(int(depth[u]) for u in pred_lists[v])
    width = max(1, max(len(p) for p in pred_lists))
    preds = np.full((n, width), n, dtype=np.int64)
    for v, p in enumerate(pred_lists):
        preds[v, : len(p)] = p
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2))
    levels = tuple(order[bounds[k] : bounds[k + 1]] for k in range(len(bounds) - 1))
    # The GPU, not the model stage: with virtual stages a GPU runs several of them.
    node_stage = np.array([c.gpu for c in dag.computations], dtype=np.int64)
    return PipelineGraph(n, dag.num_stages, levels, preds, node_stage)


def makespans_s(graph: PipelineGraph, durations_s: FloatArray) -> FloatArray:
    """Iteration time (s) of each pipeline given ``(K, num_nodes)`` computation durations (s).

    Also the earliest-finish schedule: the returned value is the finish of the last node.
    """
    durations = np.atleast_2d(np.asarray(durations_s, dtype=np.float64))
    finish = np.zeros((durations.shape[0], graph.num_nodes + 1), dtype=np.float64)
    for nodes in graph.levels:
        start = finish[:, graph.preds[nodes]].max(axis=2)
        finish[:, nodes] = start + durations[:, nodes]
    result: FloatArray = finish[:, : graph.num_nodes].max(axis=1)
    return result


@dataclass(frozen=True)
class ClockTable:
    """Measured time and energy of every node at every profiled clock of its (stage, instruction).

    Lookups take the nearest profiled clock (ties go to the higher clock, the faster one).
    """

    frequencies_mhz: tuple[IntArray, ...]  # per node
    times_s: tuple[FloatArray, ...]
    energies_j: tuple[FloatArray, ...]

    def measure(self, frequencies_mhz: IntArray) -> tuple[FloatArray, FloatArray]:
        """Time (s) and energy (J) of every node run at ``frequencies_mhz`` (one per node)."""
        n = len(self.frequencies_mhz)
        if len(frequencies_mhz) != n:
            raise PlannerError(f"need one clock per computation ({n}), got {len(frequencies_mhz)}")
        times = np.empty(n, dtype=np.float64)
        energies = np.empty(n, dtype=np.float64)
        for i, f in enumerate(np.asarray(frequencies_mhz, dtype=np.int64).tolist()):
            freqs = self.frequencies_mhz[i]
            gap = np.abs(freqs - f)
            # Nearest clock; among equally near ones the highest (never slower than asked).
            k = int(np.lexsort((-freqs, gap))[0])
            times[i] = self.times_s[i][k]
            energies[i] = self.energies_j[i][k]
        return times, energies

    def max_frequencies_mhz(self) -> IntArray:
        """The highest profiled clock of every node."""
        return np.array([int(f.max()) for f in self.frequencies_mhz], dtype=np.int64)


def clock_table(profile: Profile, dag: PipelineDAG) -> ClockTable:
    """Per-node view of the profile's measurements."""
    freqs: list[IntArray] = []
    times: list[FloatArray] = []
    energies: list[FloatArray] = []
    for comp in dag.computations:
        m = profile.get(comp.stage, comp.instruction)
        freqs.append(np.asarray(m.frequencies_mhz, dtype=np.int64))
        times.append(np.asarray(m.times_s, dtype=np.float64))
        energies.append(np.asarray(m.energies_j, dtype=np.float64))
    return ClockTable(tuple(freqs), tuple(times), tuple(energies))


@dataclass(frozen=True)
class Assignment:
    """Measured cost of one clock assignment of one pipeline, at normal speed.

    Attributes:
        frequencies_mhz: Clock of every node.
        time_s: The pipeline's own iteration time (longest path).
        busy_time_s: Sum of computation times over the pipeline's GPUs.
        busy_energy_j: Sum of computation energies.
    """

    frequencies_mhz: IntArray
    time_s: float
    busy_time_s: float
    busy_energy_j: float


def measure_assignments(
    graph: PipelineGraph, table: ClockTable, frequencies_mhz: list[IntArray]
) -> list[Assignment]:
    """Simulate one iteration of one pipeline for each clock assignment (one vectorized pass)."""
    if not frequencies_mhz:
        return []
    measured = [table.measure(f) for f in frequencies_mhz]
    times = np.stack([t for t, _ in measured])
    spans = makespans_s(graph, times)
    return [
        Assignment(np.asarray(f, dtype=np.int64), float(s), float(t.sum()), float(e.sum()))
        for f, s, (t, e) in zip(frequencies_mhz, spans, measured, strict=True)
    ]


@dataclass(frozen=True)
class RunResult:
    """Per-iteration outcome of a simulated run.

    Attributes:
        times_s: ``(I,)`` iteration time: the slowest replica's pipeline (gradient sync).
        replica_energies_j: ``(I, R)`` energy of each replica's GPUs, blocking included.
        busy_time_s: ``(I, R)`` computation time summed over each replica's GPUs.
        busy_energy_j: ``(I, R)`` computation energy of each replica.
        num_stages: GPUs per replica.
        blocking_power_w: Power of a waiting GPU.
    """

    times_s: FloatArray
    replica_energies_j: FloatArray
    busy_time_s: FloatArray
    busy_energy_j: FloatArray
    num_stages: int
    blocking_power_w: float

    @property
    def energies_j(self) -> FloatArray:
        """``(I,)`` energy of every GPU of the job per iteration."""
        total: FloatArray = self.replica_energies_j.sum(axis=1)
        return total

    def energy_at_j(self, times_s: FloatArray) -> FloatArray:
        """``(I,)`` energy had each iteration lasted ``times_s`` instead (GPUs block longer)."""
        num_gpus = self.num_stages * self.busy_time_s.shape[1]
        idle_s = num_gpus * np.asarray(times_s) - self.busy_time_s.sum(axis=1)
        total: FloatArray = self.busy_energy_j.sum(axis=1) + self.blocking_power_w * idle_s
        return total


def simulate_run(
    assignments: list[Assignment],
    choice: IntArray,
    slowdown: FloatArray,
    num_stages: int,
    blocking_power_w: float,
) -> RunResult:
    """Combine replicas: iteration ``i`` of replica ``r`` runs ``assignments[choice[i, r]]``.

    A replica slowed down by ``slowdown[i, r] = f`` takes ``f`` times longer for every
    computation at the same energy per computation (see :mod:`perseus_planner.sim`), so its
    pipeline takes ``f`` times longer. Every replica's iteration ends when the slowest one's
    does; until then its GPUs block.
    """
    choice = np.asarray(choice, dtype=np.int64)
    slowdown = np.asarray(slowdown, dtype=np.float64)
    if choice.shape != slowdown.shape or choice.ndim != 2:
        raise PlannerError("choice and slowdown must both be (iterations, replicas) arrays")
    if np.any(slowdown < 1.0) or not np.all(np.isfinite(slowdown)):
        raise PlannerError("slowdown factors must be finite and >= 1")
    own_s = np.array([a.time_s for a in assignments])[choice] * slowdown
    busy_s = np.array([a.busy_time_s for a in assignments])[choice] * slowdown
    busy_j = np.array([a.busy_energy_j for a in assignments])[choice]
    times_s = own_s.max(axis=1)
    energies = busy_j + blocking_power_w * (num_stages * times_s[:, None] - busy_s)
    return RunResult(times_s, energies, busy_s, busy_j, num_stages, blocking_power_w)
