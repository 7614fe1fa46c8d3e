"""The node plan format: consistent assignments or a precise error."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from perseus_api import NodePlan
from perseus_api.node_plan import ProfilingSpec
from support.factories import pipeline_plan_fields


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
        ([{"plan": "tmin", "stage": 0}], "needs gpu_uuid, gpu_index, or pod and local_rank"),
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


# -- profiling ------------------------------------------------------------------------------------


def _profiling(**spec: Any) -> dict[str, Any]:
    plan = _node_plan([{"gpu_index": 0, "plan": "tmin", "stage": 0}])
    plan["profiling"] = {
        "frequencies_mhz": [1410, 1200, 1005],
        "iterations_per_frequency": 3,
        "warmup_iterations": 1,
        **spec,
    }
    return plan


def test_node_plan_without_profiling_has_none() -> None:
    plan = NodePlan.model_validate(_node_plan([{"gpu_index": 0, "plan": "tmin", "stage": 0}]))
    assert plan.profiling is None


def test_profiling_spec_round_trips() -> None:
    plan = NodePlan.model_validate(_profiling(warmup_iterations=0))
    assert isinstance(plan.profiling, ProfilingSpec)
    assert plan.profiling.frequencies_mhz == [1410, 1200, 1005]
    assert (plan.profiling.iterations_per_frequency, plan.profiling.warmup_iterations) == (3, 0)
    assert NodePlan.model_validate_json(plan.model_dump_json()) == plan
    # A single clock is a valid run (e.g. re-measuring one point).
    assert NodePlan.model_validate(_profiling(frequencies_mhz=[1005])).profiling is not None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"frequencies_mhz": []}, "frequencies_mhz\n  List should have at least 1 item"),
        ({"frequencies_mhz": [1410, 0]}, "frequencies_mhz.1\n  Input should be greater than 0"),
        ({"frequencies_mhz": [1410, 1005, 1410]}, "1410 MHz is listed more than once"),
        (
            {"frequencies_mhz": [1005, 1410]},
            "descending order \\(highest first\\); 1410 MHz comes after 1005 MHz",
        ),
        ({"iterations_per_frequency": 0}, "iterations_per_frequency\n  Input should be greater"),
        ({"warmup_iterations": -1}, "warmup_iterations\n  Input should be greater than or equal"),
        ({"repeat": 2}, "repeat\n  Extra inputs are not permitted"),
    ],
)
def test_invalid_profiling_specs_are_rejected(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        NodePlan.model_validate(_profiling(**spec))


def test_profiling_spec_needs_its_fields() -> None:
    plan = _profiling()
    del plan["profiling"]["iterations_per_frequency"]
    with pytest.raises(ValidationError, match="iterationsPerFrequency\n  Field required"):
        NodePlan.model_validate(plan)
