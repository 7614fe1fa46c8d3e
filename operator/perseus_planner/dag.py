"""Computation DAGs of one training iteration of a pipeline-parallel job.

Nodes are computations (one forward or backward of one microbatch on one stage);
edges are the dependencies that any correct execution has to respect:

- the order in which each stage executes its own computations (the schedule),
- ``forward(s, m) -> forward(s + 1, m)`` (activations flow down the pipeline),
- ``backward(s + 1, m) -> backward(s, m)`` (gradients flow back up).

The last stage runs ``backward(S-1, m)`` after ``forward(S-1, m)`` in its own
order, so that dependency is carried by the stage order. Edges implied by others
are never added: a redundant edge would look like a critical dependency that can
never be shortened and would stop the frontier solver early.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_api.errors import ScheduleError
from perseus_api.schedule import (
    BACKWARD,
    FORWARD,
    Schedule,
    stage_instruction_order,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "Computation",
    "PipelineDAG",
    "Schedule",
    "build_pipeline_dag",
    "stage_instruction_order",
    "topological_order",
    "validate_dag",
]


@dataclass(frozen=True)
class Computation:
    """One node of the DAG."""

    stage: int
    microbatch: int
    instruction: str  # FORWARD or BACKWARD


@dataclass(frozen=True)
class PipelineDAG:
    """A validated computation DAG of one pipeline iteration.

    Attributes:
        schedule: Schedule it was built for.
        num_stages: Pipeline stages (one GPU, or one tensor-parallel group, each).
        num_microbatches: Microbatches per iteration.
        computations: Nodes; index ``i`` is node ``i`` everywhere else.
        edges: ``(E, 2)`` int64 array of dependencies ``u -> v``.
        stage_order: For each stage, its node indices in execution order.
    """

    schedule: Schedule
    num_stages: int
    num_microbatches: int
    computations: tuple[Computation, ...]
    edges: npt.NDArray[np.int64]
    stage_order: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.computations)


def build_pipeline_dag(
    schedule: Schedule | str, num_stages: int, num_microbatches: int
) -> PipelineDAG:
    """Build the computation DAG of one iteration.

    Raises:
        ScheduleError: On non-positive sizes or an unknown schedule.
    """
    sched = schedule if isinstance(schedule, Schedule) else Schedule.parse(schedule)
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    num_stages, num_microbatches = int(num_stages), int(num_microbatches)

    computations: list[Computation] = []
    index: dict[tuple[int, str, int], int] = {}
    stage_order: list[tuple[int, ...]] = []
    for stage in range(num_stages):
        order: list[int] = []
        for instruction, mb in stage_instruction_order(sched, num_stages, num_microbatches, stage):
            index[(stage, instruction, mb)] = len(computations)
            order.append(len(computations))
            computations.append(Computation(stage, mb, instruction))
        stage_order.append(tuple(order))

    edges: list[tuple[int, int]] = []
    for stage_nodes in stage_order:
        edges.extend(itertools.pairwise(stage_nodes))
    for stage in range(num_stages - 1):
        for mb in range(num_microbatches):
            edges.append((index[(stage, FORWARD, mb)], index[(stage + 1, FORWARD, mb)]))
            edges.append((index[(stage + 1, BACKWARD, mb)], index[(stage, BACKWARD, mb)]))

    dag = PipelineDAG(
        schedule=sched,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        computations=tuple(computations),
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        stage_order=tuple(stage_order),
    )
    validate_dag(dag)
    return dag


def topological_order(num_nodes: int, edges: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Kahn's algorithm; raises ScheduleError on a cycle."""
    indegree = (
        np.bincount(edges[:, 1], minlength=num_nodes)
        if len(edges)
        else np.zeros(num_nodes, dtype=np.int64)
    )
    succ: list[list[int]] = [[] for _ in range(num_nodes)]
    for u, v in edges.tolist():
        succ[u].append(v)
    ready = [v for v in range(num_nodes) if indegree[v] == 0]
    order: list[int] = []
    while ready:
        u = ready.pop()
        order.append(u)
        for v in succ[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    if len(order) != num_nodes:
        raise ScheduleError("the dependency graph has a cycle")
    return np.asarray(order, dtype=np.int64)


def validate_dag(dag: PipelineDAG) -> None:
    """Check the invariants the solver relies on.

    Every computation appears exactly once in its stage order, the graph is
    acyclic, there are no duplicate edges, and each stage runs the forward of a
    microbatch before its backward.
    """
    n = dag.num_nodes
    seen = sorted(i for order in dag.stage_order for i in order)
    if seen != list(range(n)):
        raise ScheduleError("stage orders must list every computation exactly once")
    for order in dag.stage_order:
        stages = {dag.computations[i].stage for i in order}
        if len(stages) > 1:
            raise ScheduleError(f"a stage order mixes stages {sorted(stages)}")
        position = {
            (dag.computations[i].instruction, dag.computations[i].microbatch): k
            for k, i in enumerate(order)
        }
        for (instruction, mb), k in position.items():
            if instruction == BACKWARD and position.get((FORWARD, mb), n) > k:
                raise ScheduleError(
                    f"stage {dag.computations[order[0]].stage} runs backward of microbatch "
                    f"{mb} before its forward"
                )
    pairs = {tuple(e) for e in dag.edges.tolist()}
    if len(pairs) != len(dag.edges):
        raise ScheduleError("duplicate dependency edges")
    topological_order(n, dag.edges)
