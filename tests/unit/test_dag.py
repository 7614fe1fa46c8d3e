"""Tests for perseus_planner.dag: node counts, schedule orders, dependencies, bad input."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from perseus_api.errors import ApiError
from perseus_planner.dag import (
    BACKWARD,
    FORWARD,
    PipelineDAG,
    Schedule,
    build_pipeline_dag,
    stage_instruction_order,
    topological_order,
)
from perseus_planner.errors import ScheduleError

SIZES = [(1, 1), (1, 4), (2, 2), (4, 2), (4, 6), (3, 7), (8, 12)]


def _order(dag: PipelineDAG, stage: int) -> list[str]:
    """A stage's order as compact labels, e.g. ``["F0", "F1", "B0"]``."""
    labels = []
    for i in dag.stage_order[stage]:
        comp = dag.computations[i]
        assert comp.stage == stage
        labels.append(("F" if comp.instruction == FORWARD else "B") + str(comp.microbatch))
    return labels


def _seq(labels: str) -> list[str]:
    return labels.split()


def _index(dag: PipelineDAG) -> dict[tuple[int, str, int], int]:
    return {(c.stage, c.instruction, c.microbatch): i for i, c in enumerate(dag.computations)}


def _reachable(dag: PipelineDAG, source: int) -> set[int]:
    succ: dict[int, list[int]] = {}
    for u, v in dag.edges.tolist():
        succ.setdefault(u, []).append(v)
    seen, stack = {source}, [source]
    while stack:
        for v in succ.get(stack.pop(), []):
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return seen


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", Schedule.ONE_F_ONE_B, Schedule.GPIPE])
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_node_count_and_every_computation_once(
    schedule: str | Schedule, stages: int, microbatches: int
) -> None:
    dag = build_pipeline_dag(schedule, stages, microbatches)
    assert dag.schedule is Schedule(schedule)
    assert dag.num_stages == stages
    assert dag.num_microbatches == microbatches
    assert dag.num_nodes == len(dag.computations) == 2 * stages * microbatches
    expected = {
        (s, ins, m)
        for s in range(stages)
        for ins in (FORWARD, BACKWARD)
        for m in range(microbatches)
    }
    assert set(_index(dag)) == expected
    assert len(dag.stage_order) == stages
    assert sorted(i for order in dag.stage_order for i in order) == list(range(dag.num_nodes))
    assert all(len(order) == 2 * microbatches for order in dag.stage_order)


def test_1f1b_stage_orders_s4_m6() -> None:
    # Megatron-LM / DeepSpeed: min(S - s - 1, M) warm-up forwards, 1F1B, then drain.
    dag = build_pipeline_dag("1f1b", 4, 6)
    assert _order(dag, 0) == _seq("F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5")
    assert _order(dag, 1) == _seq("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5")
    assert _order(dag, 2) == _seq("F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5")
    assert _order(dag, 3) == _seq("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5")


def test_1f1b_stage_orders_fewer_microbatches_than_stages() -> None:
    dag = build_pipeline_dag("1f1b", 4, 2)
    assert _order(dag, 0) == _seq("F0 F1 B0 B1")
    assert _order(dag, 1) == _seq("F0 F1 B0 B1")
    assert _order(dag, 2) == _seq("F0 F1 B0 B1")
    assert _order(dag, 3) == _seq("F0 B0 F1 B1")


@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_1f1b_order_matches_megatron_formula(stages: int, microbatches: int) -> None:
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        expected = [(FORWARD, m) for m in range(warmup)]
        for i in range(microbatches - warmup):
            expected += [(FORWARD, warmup + i), (BACKWARD, i)]
        expected += [(BACKWARD, m) for m in range(microbatches - warmup, microbatches)]
        assert stage_instruction_order(Schedule.ONE_F_ONE_B, stages, microbatches, stage) == (
            expected
        )


def test_gpipe_all_forwards_then_all_backwards() -> None:
    dag = build_pipeline_dag("GPipe", 3, 4)
    for stage in range(3):
        assert _order(dag, stage) == _seq("F0 F1 F2 F3 B0 B1 B2 B3")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_edges(schedule: str, stages: int, microbatches: int) -> None:
    dag = build_pipeline_dag(schedule, stages, microbatches)
    idx = _index(dag)
    edges = [tuple(e) for e in dag.edges.tolist()]
    assert dag.edges.dtype == np.int64
    assert dag.edges.shape == (len(edges), 2)
    assert len(set(edges)) == len(edges), "duplicate edges"
    assert all(u != v for u, v in edges)
    edge_set = set(edges)
    for s in range(stages - 1):
        for m in range(microbatches):
            assert (idx[(s, FORWARD, m)], idx[(s + 1, FORWARD, m)]) in edge_set
            assert (idx[(s + 1, BACKWARD, m)], idx[(s, BACKWARD, m)]) in edge_set
    # Consecutive computations of a stage are chained.
    for order in dag.stage_order:
        for u, v in itertools.pairwise(order):
            assert (u, v) in edge_set
    # Nothing else: stage chains plus the cross-stage dependencies.
    expected = sum(len(o) - 1 for o in dag.stage_order) + 2 * (stages - 1) * microbatches
    assert len(edges) == expected


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("stages", "microbatches"), SIZES)
def test_acyclic_and_forward_before_backward(schedule: str, stages: int, microbatches: int) -> None:
    dag = build_pipeline_dag(schedule, stages, microbatches)
    topo = topological_order(dag.num_nodes, dag.edges).tolist()
    assert sorted(topo) == list(range(dag.num_nodes))
    position = {v: k for k, v in enumerate(topo)}
    assert all(position[u] < position[v] for u, v in dag.edges.tolist())
    idx = _index(dag)
    last = stages - 1
    for m in range(microbatches):
        forward, backward = idx[(last, FORWARD, m)], idx[(last, BACKWARD, m)]
        assert backward in _reachable(dag, forward)
        order = list(dag.stage_order[last])
        assert order.index(forward) < order.index(backward)
        # The first stage's backward of m depends (transitively) on its own forward of m.
        assert idx[(0, BACKWARD, m)] in _reachable(dag, idx[(0, FORWARD, m)])


def test_cycle_is_detected() -> None:
    with pytest.raises(ScheduleError, match="cycle"):
        topological_order(3, np.array([[0, 1], [1, 2], [2, 0]], dtype=np.int64))


@pytest.mark.parametrize("spelling", ["1F1B", " 1f1b ", "GPipe", "gpipe"])
def test_schedule_spellings(spelling: str) -> None:
    assert Schedule.parse(spelling).value == spelling.strip().lower()


@pytest.mark.parametrize(
    ("stages", "microbatches", "message"),
    [
        (0, 4, "num_stages must be a positive integer, got 0"),
        (4, -1, "num_microbatches must be a positive integer, got -1"),
        (True, 4, "num_stages must be a positive integer, got True"),
        (4, "x", "num_microbatches must be a positive integer, got 'x'"),
        (2.0, 4, "num_stages must be a positive integer, got 2.0"),
    ],
)
def test_invalid_sizes(stages: object, microbatches: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(message)):
        build_pipeline_dag("1f1b", stages, microbatches)  # type: ignore[arg-type]


def test_unknown_schedule() -> None:
    with pytest.raises(ScheduleError) as info:
        build_pipeline_dag("zb-v", 4, 8)
    message = str(info.value)
    assert "unknown schedule 'zb-v'" in message
    assert "1f1b" in message
    assert "gpipe" in message
    assert isinstance(info.value, ApiError)
    assert isinstance(info.value, ValueError)
