"""The frontier solver against exhaustive search on pipelines small enough to enumerate.

Every point the Phillips–Dessouky iteration emits must be a minimum-cost assignment of
integer durations among all assignments that finish within the point's iteration time.
Costs are the solver's own (fitted) cost tables, read through ``problem.cost_j``, so the
comparison checks the search, not the cost model.

Most cases give every (stage, instruction) four or five clocks, so the exponential model is a
real least-squares fit; 12-computation pipelines then have 4**12 assignments, enumerated in
chunks. One case uses two and three clocks, where the cost model falls back to a line or
interpolates exactly.
"""

from __future__ import annotations

import pytest

from perseus_planner.dag import Schedule, build_pipeline_dag
from perseus_planner.solver import build_problem
from support.exhaustive_frontier import (
    BLOCKING_W,
    UNIT_S,
    Spec,
    assert_frontier_is_optimal,
    assert_one_option_per_clock,
    synthetic_profile,
)

# (stage, instruction) -> (fastest time in ms, energy scale, number of clocks). Clock ``k`` runs
# ``fastest + k + 0.5`` ms, so every clock quantizes to its own whole millisecond, away from
# floor-rounding edges. Stages differ so that the faster ones have slack.
SPEC_2_STAGES: Spec = {
    (0, "forward"): (10, 1.0, 5),
    (0, "backward"): (20, 2.5, 4),
    (1, "forward"): (12, 1.6, 4),
    (1, "backward"): (22, 3.0, 5),
}
SPEC_2_STAGES_SMALL: Spec = {
    (0, "forward"): (10, 1.0, 4),
    (0, "backward"): (20, 2.5, 4),
    (1, "forward"): (12, 1.6, 4),
    (1, "backward"): (23, 3.0, 4),
}
SPEC_FEW_CLOCKS: Spec = {
    (0, "forward"): (10, 1.0, 2),
    (0, "backward"): (20, 2.5, 3),
    (1, "forward"): (12, 1.6, 3),
    (1, "backward"): (22, 3.0, 2),
}
SPEC_3_STAGES: Spec = {
    (0, "forward"): (10, 1.0, 4),
    (0, "backward"): (19, 2.2, 4),
    (1, "forward"): (13, 1.7, 4),
    (1, "backward"): (24, 3.1, 4),
    (2, "forward"): (11, 1.3, 4),
    (2, "backward"): (21, 2.6, 4),
}


CASES = [
    pytest.param(Schedule.ONE_F_ONE_B, 2, 2, SPEC_2_STAGES, id="1f1b-S2-M2"),
    pytest.param(Schedule.ONE_F_ONE_B, 2, 3, SPEC_2_STAGES_SMALL, id="1f1b-S2-M3"),
    pytest.param(Schedule.ONE_F_ONE_B, 3, 2, SPEC_3_STAGES, id="1f1b-S3-M2"),
    pytest.param(Schedule.ONE_F_ONE_B, 2, 3, SPEC_FEW_CLOCKS, id="1f1b-S2-M3-few-clocks"),
    pytest.param(Schedule.GPIPE, 2, 2, SPEC_2_STAGES, id="gpipe-S2-M2"),
    pytest.param(Schedule.GPIPE, 2, 3, SPEC_2_STAGES_SMALL, id="gpipe-S2-M3"),
    pytest.param(Schedule.GPIPE, 3, 2, SPEC_3_STAGES, id="gpipe-S3-M2"),
]


@pytest.mark.parametrize(("schedule", "stages", "microbatches", "specs"), CASES)
def test_every_frontier_point_is_optimal(
    schedule: Schedule, stages: int, microbatches: int, specs: Spec
) -> None:
    problem = build_problem(
        synthetic_profile(specs),
        build_pipeline_dag(schedule, stages, microbatches),
        UNIT_S,
        BLOCKING_W,
    )
    assert_frontier_is_optimal(problem)


@pytest.mark.parametrize(
    "specs",
    [SPEC_2_STAGES, SPEC_2_STAGES_SMALL, SPEC_3_STAGES, SPEC_FEW_CLOCKS],
    ids=["S2", "S2-small", "S3", "few-clocks"],
)
def test_synthetic_profiles_keep_one_option_per_clock(specs: Spec) -> None:
    # Guards the test design: the enumeration above covers one duration per profiled clock.
    num_stages = 1 + max(stage for stage, _ in specs)
    problem = build_problem(
        synthetic_profile(specs), build_pipeline_dag("1f1b", num_stages, 2), UNIT_S, BLOCKING_W
    )
    assert_one_option_per_clock(problem, specs)
