"""The node plan format: consistent assignments or a precise error."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from factories import pipeline_plan_fields
from perseus_api import NodePlan


def _node_plan(assignments: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "node": "gpu-node-1",
        "namespace": "ml",
        "job": "gpt3",
        "revision": 3,
        "granularity": "Stage",
        "plans": {"tmin": pipeline_plan_fields(num_stages=2)},
        "assignments": assignments,
    }


def test_valid_node_plan() -> None:
    plan = NodePlan.model_validate(
        _node_plan(
            [
                {"gpu_uuid": "GPU-a", "plan": "tmin", "stage": 0, "rank": 0},
                {"gpu_index": 1, "plan": "tmin", "stage": 1, "dp_rank": 0, "rank": 1},
            ]
        )
    )
    assert [a.gpu_label for a in plan.assignments] == ["GPU-a", "index 1"]
    assert NodePlan.model_validate_json(plan.model_dump_json()) == plan


@pytest.mark.parametrize(
    ("assignments", "message"),
    [
        ([{"plan": "tmin", "stage": 0}], "needs gpu_uuid or gpu_index"),
        ([{"gpu_index": 0, "plan": "slow", "stage": 0}], "unknown plan 'slow' \\(tmin\\)"),
        ([{"gpu_index": 0, "plan": "tmin", "stage": 2}], "stage 2 but plan 'tmin' has 2 stages"),
        (
            [
                {"gpu_uuid": "GPU-a", "plan": "tmin", "stage": 0},
                {"gpu_uuid": "GPU-a", "plan": "tmin", "stage": 1},
            ],
            "GPU GPU-a is assigned twice",
        ),
        ([{"gpu_index": -1, "plan": "tmin", "stage": 0}], "greater than or equal to 0"),
    ],
)
def test_inconsistent_node_plans_are_rejected(
    assignments: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        NodePlan.model_validate(_node_plan(assignments))
