"""Computation DAGs of one training iteration of a pipeline-parallel job.

Nodes are computations: one forward, backward (or, for zero-bubble schedules, one
backward-input or backward-weight) of one microbatch on one model stage. With virtual
stages (interleaved 1F1B) GPU ``p`` runs model stages ``v * P + p``; otherwise model
stage and GPU coincide. Edges are the dependencies any correct execution respects:

- the order in which each GPU executes its own computations (the schedule),
- ``forward(s, m) -> forward(s + 1, m)`` (activations flow down the model stages),
- ``backward(s + 1, m) -> backward(s, m)`` (gradients flow back up; the backward-input
  when the backward is split),
- on one model stage, a backward after its forward and a backward-weight after its
  backward-input.

Dependencies between two computations of the same GPU are carried by its order (the
builder checks that the order respects them), so only those across GPUs become edges.
Edges implied by others are never added: a redundant edge would look like a critical
dependency that can never be shortened and would stop the frontier solver early.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from perseus_api.errors import ScheduleError
from perseus_api.schedule import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Schedule,
    check_schedule_sizes,
    gpu_computation_order,
    stage_instruction_order,
)

__all__ = [
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
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
    """One node of the DAG.

    Attributes:
        stage: The model stage whose profile row it uses (the virtual stage ``v * P + p``
            with interleaving; otherwise the GPU's pipeline stage).
        microbatch: Its microbatch.
        instruction: ``forward``, ``backward``, ``backward_input`` or ``backward_weight``.
        gpu: The pipeline stage (GPU, or tensor-parallel group) that runs it.
    """

    stage: int
    microbatch: int
    instruction: str
    gpu: int


@dataclass(frozen=True)
class PipelineDAG:
    """A validated computation DAG of one pipeline iteration.

    Attributes:
        schedule: Schedule it was built for.
        num_stages: Pipeline stages (one GPU, or one tensor-parallel group, each): the
            GPUs that draw blocking power while they wait.
        num_microbatches: Microbatches per iteration.
        computations: Nodes; index ``i`` is node ``i`` everywhere else.
        edges: ``(E, 2)`` int64 array of dependencies ``u -> v``.
        stage_order: For each GPU (pipeline stage), its node indices in execution order.
        virtual_stages: Model stages per GPU (``V``; 1 but for interleaved 1F1B).
    """

    schedule: Schedule
    num_stages: int
    num_microbatches: int
    computations: tuple[Computation, ...]
    edges: npt.NDArray[np.int64]
    stage_order: tuple[tuple[int, ...], ...]
    virtual_stages: int = 1

    @property
    def num_nodes(self) -> int:
        return len(self.computations)

    @property
    def num_model_stages(self) -> int:
        """Model stages (profile stages): ``num_stages * virtual_stages``."""
        return self.num_stages * self.virtual_stages


def build_pipeline_dag(
    schedule: Schedule | str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineDAG:
    """Build the computation DAG of one iteration.

    Raises:
        ScheduleError: On non-positive sizes, sizes the schedule does not accept (see
            :func:`perseus_api.schedule.check_schedule_sizes`) or an unknown schedule.
    """
    sched = check_schedule_sizes(schedule, num_stages, num_microbatches, virtual_stages)
    num_stages, num_microbatches = int(num_stages), int(num_microbatches)
    virtual_stages = int(virtual_stages)
    computations: list[Computation] = []
    index: dict[tuple[int, str, int], int] = {}
    stage_order: list[tuple[int, ...]] = []
    for gpu in range(num_stages):
        order: list[int] = []
        for step in gpu_computation_order(sched, num_stages, num_microbatches, gpu, virtual_stages):
            index[(step.virtual_stage, step.instruction, step.microbatch)] = len(computations)
            order.append(len(computations))
            computations.append(
                Computation(step.virtual_stage, step.microbatch, step.instruction, gpu)
            )
        stage_order.append(tuple(order))

    position = {i: k for order in stage_order for k, i in enumerate(order)}
    edges: list[tuple[int, int]] = []
    for gpu_nodes in stage_order:
        edges.extend(itertools.pairwise(gpu_nodes))
    for u, v in _dependencies(sched, num_stages * virtual_stages, num_microbatches, index):
        if computations[u].gpu != computations[v].gpu:
            edges.append((u, v))
        elif position[u] > position[v]:
            a, b = computations[u], computations[v]
            raise ScheduleError(
                f"GPU {a.gpu} runs {b.instruction} of microbatch {b.microbatch} on stage "
                f"{b.stage} before {a.instruction} of microbatch {a.microbatch} on stage "
                f"{a.stage}, which it depends on"
            )

    dag = PipelineDAG(
        schedule=sched,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        computations=tuple(computations),
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        stage_order=tuple(stage_order),
        virtual_stages=virtual_stages,
    )
    validate_dag(dag)
    return dag


def _dependencies(
    schedule: Schedule,
    model_stages: int,
    num_microbatches: int,
    index: dict[tuple[int, str, int], int],
) -> list[tuple[int, int]]:
    """Every data dependency ``u -> v`` between computations, by node index."""
    grad = BACKWARD_INPUT if schedule.splits_backward else BACKWARD
    deps: list[tuple[int, int]] = []
    for mb in range(num_microbatches):
        for s in range(model_stages):
            deps.append((index[(s, FORWARD, mb)], index[(s, grad, mb)]))
            if schedule.splits_backward:
                deps.append((index[(s, BACKWARD_INPUT, mb)], index[(s, BACKWARD_WEIGHT, mb)]))
            if s + 1 < model_stages:
                deps.append((index[(s, FORWARD, mb)], index[(s + 1, FORWARD, mb)]))
                deps.append((index[(s + 1, grad, mb)], index[(s, grad, mb)]))
    return deps


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


_RUNS_AFTER = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}
"""On one model stage and microbatch, the computation each kind has to follow."""


def validate_dag(dag: PipelineDAG) -> None:
    """Check the invariants the solver relies on.

    Every computation appears exactly once in its GPU's order, the graph is acyclic, there
    are no duplicate edges, and each model stage runs the forward of a microbatch before its
    backward (and a backward-input before its backward-weight).
    """
    n = dag.num_nodes
    seen = sorted(i for order in dag.stage_order for i in order)
    if seen != list(range(n)):
        raise ScheduleError("stage orders must list every computation exactly once")
    for gpu, order in enumerate(dag.stage_order):
        gpus = {dag.computations[i].gpu for i in order}
        if gpus - {gpu}:
            raise ScheduleError(f"the order of GPU {gpu} mixes GPUs {sorted(gpus)}")
        position = {
            (
                dag.computations[i].stage,
                dag.computations[i].instruction,
                dag.computations[i].microbatch,
            ): k
            for k, i in enumerate(order)
        }
        for (stage, instruction, mb), k in position.items():
            first = _RUNS_AFTER.get(instruction)
            if first is not None and position.get((stage, first, mb), n) > k:
                raise ScheduleError(
                    f"stage {stage} runs {instruction} of microbatch {mb} before its {first}"
                )
    pairs = {tuple(e) for e in dag.edges.tolist()}
    if len(pairs) != len(dag.edges):
        raise ScheduleError("duplicate dependency edges")
    topological_order(n, dag.edges)
