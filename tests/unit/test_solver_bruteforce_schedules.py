"""The frontier solver against exhaustive search for interleaved 1F1B and ZB-H1.

As :mod:`test_solver_bruteforce` does for 1F1B and GPipe (with the same helpers): every point
the solver emits must cost no more than the cheapest of all integer duration assignments that
finish within the point's iteration time, on pipelines small enough to enumerate. Interleaved
1F1B with P=2, V=2, M=2 has 16 computations, so most of its (model stage, instruction) pairs
get two or three clocks (the cost model interpolates or falls back to a line); ZB-H1 with P=2,
M=2 has 12 and gets four or five, a real least-squares fit.
"""

from __future__ import annotations

import pytest

from perseus_planner.dag import build_pipeline_dag
from perseus_planner.model_stages import solver_profile
from perseus_planner.solver import build_problem
from support.exhaustive_frontier import (
    BLOCKING_W,
    UNIT_S,
    Spec,
    assert_frontier_is_optimal,
    assert_one_option_per_clock,
    synthetic_profile,
)

# Model stage v*P + p runs on GPU p: stages 0 and 2 on GPU 0, 1 and 3 on GPU 1.
SPEC_INTERLEAVED_P2_V2: Spec = {
    (0, "forward"): (5, 1.0, 3),
    (0, "backward"): (10, 2.5, 2),
    (1, "forward"): (6, 1.6, 3),
    (1, "backward"): (12, 3.0, 2),
    (2, "forward"): (4, 0.8, 2),
    (2, "backward"): (9, 2.0, 3),
    (3, "forward"): (6, 1.4, 2),
    (3, "backward"): (11, 2.8, 3),
}
SPEC_ZB_P2: Spec = {
    (0, "forward"): (10, 1.0, 4),
    (0, "backward_input"): (9, 1.2, 4),
    (0, "backward_weight"): (8, 1.1, 4),
    (1, "forward"): (12, 1.6, 4),
    (1, "backward_input"): (11, 1.5, 5),
    (1, "backward_weight"): (7, 1.0, 4),
}

CASES = [
    pytest.param("interleaved-1f1b", 2, 2, 2, SPEC_INTERLEAVED_P2_V2, id="interleaved-P2-V2-M2"),
    pytest.param("zb-h1", 2, 2, 1, SPEC_ZB_P2, id="zb-h1-P2-M2"),
]


@pytest.mark.parametrize(("schedule", "gpus", "microbatches", "virtual", "specs"), CASES)
def test_every_frontier_point_is_optimal(
    schedule: str, gpus: int, microbatches: int, virtual: int, specs: Spec
) -> None:
    dag = build_pipeline_dag(schedule, gpus, microbatches, virtual)
    problem = build_problem(solver_profile(synthetic_profile(specs), dag), dag, UNIT_S, BLOCKING_W)
    # Blocking power counts GPUs, not model stages.
    assert problem.num_stages == gpus
    assert problem.dag.num_nodes == len(specs) * microbatches
    assert_frontier_is_optimal(problem)


@pytest.mark.parametrize(("schedule", "gpus", "microbatches", "virtual", "specs"), CASES)
def test_each_computation_uses_its_own_model_stage(
    schedule: str, gpus: int, microbatches: int, virtual: int, specs: Spec
) -> None:
    # Guards the test design: one option per profiled clock, looked up by model stage.
    dag = build_pipeline_dag(schedule, gpus, microbatches, virtual)
    problem = build_problem(solver_profile(synthetic_profile(specs), dag), dag, UNIT_S, BLOCKING_W)
    assert_one_option_per_clock(problem, specs)
