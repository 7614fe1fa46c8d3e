"""The simulator's engine on pipelines small enough to schedule by hand."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_api.profile import parse_profile
from perseus_planner import PlannerError, build_pipeline_dag
from perseus_planner.sim import (
    ClockTable,
    PipelineGraph,
    clock_table,
    makespans_s,
    measure_assignments,
    pipeline_graph,
    simulate_run,
)

BLOCKING_W = 5.0

# Two stages, two clocks. At 1000 MHz a forward takes 1 s / 10 J and a backward 2 s / 20 J on
# both stages; at 500 MHz everything takes twice as long for 8 J / 16 J.
PROFILE = parse_profile(
    "stage,instruction,frequency,time,energy\n"
    + "".join(
        f"{s},forward,1000,1.0,10.0\n{s},backward,1000,2.0,20.0\n"
        f"{s},forward,500,2.0,8.0\n{s},backward,500,4.0,16.0\n"
        for s in range(2)
    ),
    "tiny.csv",
)


def _run(schedule: str, clock_mhz: int) -> tuple[float, float, float]:
    dag = build_pipeline_dag(schedule, 2, 2)
    (run,) = measure_assignments(
        pipeline_graph(dag), clock_table(PROFILE, dag), [np.full(dag.num_nodes, clock_mhz)]
    )
    return run.time_s, run.busy_time_s, run.busy_energy_j


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_two_microbatches_by_hand(schedule: str) -> None:
    # 1F1B. Stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7];
    # stage 0: B0 [4,6] (waits for stage 1's B0), B1 [7,9]. GPipe: stage 1 runs F0 [1,2]
    # F1 [2,3] B0 [3,5] B1 [5,7], stage 0 B0 [5,7] B1 [7,9]. Both end at 9 s.
    time_s, busy_s, busy_j = _run(schedule, 1000)
    assert time_s == 9.0
    assert busy_s == 12.0  # 2 stages x (1 + 1 + 2 + 2)
    assert busy_j == 120.0  # 2 stages x (10 + 10 + 20 + 20)
    # Energy of the pipeline: 120 J computing + 5 W x (2 GPUs x 9 s - 12 s) waiting = 150 J.
    result = simulate_run(
        measure_assignments(*_graph_and_table(schedule), [np.full(8, 1000)]),
        np.zeros((1, 1), dtype=np.int64),
        np.ones((1, 1)),
        num_stages=2,
        blocking_power_w=BLOCKING_W,
    )
    assert result.times_s.tolist() == [9.0]
    assert result.energies_j.tolist() == [150.0]


def _graph_and_table(schedule: str) -> tuple[PipelineGraph, ClockTable]:
    dag = build_pipeline_dag(schedule, 2, 2)
    return pipeline_graph(dag), clock_table(PROFILE, dag)


def test_lower_clock_doubles_time_and_nearest_clock_is_used() -> None:
    assert _run("1f1b", 500) == (18.0, 24.0, 96.0)
    assert _run("1f1b", 990) == _run("1f1b", 1000)
    assert _run("1f1b", 600) == _run("1f1b", 500)
    assert _run("1f1b", 750) == _run("1f1b", 1000)  # equally near: the faster clock


def test_straggler_and_gradient_sync_blocking() -> None:
    dag = build_pipeline_dag("1f1b", 2, 2)
    runs = measure_assignments(
        pipeline_graph(dag), clock_table(PROFILE, dag), [np.full(dag.num_nodes, 1000)]
    )
    # Replica 1 is 1.5x slower from iteration 1 on, at the same energy per computation.
    slowdown = np.array([[1.0, 1.0], [1.0, 1.5]])
    result = simulate_run(runs, np.zeros((2, 2), dtype=np.int64), slowdown, 2, BLOCKING_W)
    assert result.times_s.tolist() == [9.0, 13.5]
    # Iteration 1: replica 0 computes 12 s and waits 27 - 12 = 15 s at 5 W: 120 + 75 J;
    # replica 1 computes 18 s for the same 120 J and waits 9 s: 120 + 45 J.
    assert result.replica_energies_j.tolist() == [[150.0, 150.0], [195.0, 165.0]]
    assert result.energies_j.tolist() == [300.0, 360.0]
    # Stretched to 10 s, iteration 0 blocks 4 GPUs x 10 s - 24 s busy = 16 s: 240 + 80 J.
    assert result.energy_at_j(np.array([10.0, 13.5])).tolist() == [320.0, 360.0]


def test_vectorized_makespans_match_one_by_one() -> None:
    dag = build_pipeline_dag("1f1b", 4, 6)
    graph = pipeline_graph(dag)
    rng = np.random.default_rng(7)
    durations = rng.uniform(0.5, 2.0, size=(5, dag.num_nodes))
    together = makespans_s(graph, durations)
    assert together.tolist() == [float(makespans_s(graph, d)[0]) for d in durations]


def test_bad_inputs_are_rejected() -> None:
    graph, table = _graph_and_table("1f1b")
    with pytest.raises(PlannerError, match="one clock per computation"):
        measure_assignments(graph, table, [np.full(3, 1000)])
    runs = measure_assignments(graph, table, [np.full(8, 1000)])
    with pytest.raises(PlannerError, match=">= 1"):
        simulate_run(runs, np.zeros((1, 1), dtype=np.int64), np.full((1, 1), 0.5), 2, 1.0)
