"""The plan wire format rejects inconsistent plans and round-trips through JSON."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from perseus_api import Granularity, PipelinePlan, PlanObjective


def _plan_fields(num_stages: int = 2, num_microbatches: int = 2) -> dict[str, Any]:
    estimate = {"iteration_time_s": 1.0, "energy_j": 100.0, "savings_ratio": 0.1}
    return {
        "schedule": "1f1b",
        "num_stages": num_stages,
        "num_microbatches": num_microbatches,
        "granularity": "Instruction",
        "objective": "MinTime",
        "unit_time_s": 0.001,
        "blocking_power_w": 80.0,
        "t_min_s": 1.0,
        "t_star_s": 1.2,
        "baseline_iteration_time_s": 1.01,
        "instruction_estimate": estimate,
        "stage_estimate": estimate,
        "stages": [
            {
                "stage": s,
                "frequency_mhz": 1410,
                "instructions": [
                    {"instruction": kind, "microbatch": m, "frequency_mhz": 1200}
                    for m in range(num_microbatches)
                    for kind in ("forward", "backward")
                ],
            }
            for s in range(num_stages)
        ],
    }


def test_valid_plan_round_trips_through_json() -> None:
    plan = PipelinePlan.model_validate(_plan_fields())
    assert plan.granularity is Granularity.INSTRUCTION
    assert plan.objective is PlanObjective.MIN_TIME
    assert plan.api_version == "perseus.energy/v1alpha1"
    again = PipelinePlan.model_validate_json(plan.model_dump_json())
    assert again == plan


def test_stages_must_be_complete_and_ordered() -> None:
    fields = _plan_fields()
    fields["stages"] = list(reversed(fields["stages"]))
    with pytest.raises(ValidationError, match=r"stages 0\.\.1 in order"):
        PipelinePlan.model_validate(fields)


def test_each_stage_lists_a_forward_and_backward_per_microbatch() -> None:
    fields = _plan_fields()
    fields["stages"][1]["instructions"].pop()
    with pytest.raises(ValidationError, match="stage 1 lists 3 computations, expected 4"):
        PipelinePlan.model_validate(fields)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("granularity",), "PerGPU", "Stage"),
        (("stages", 0, "frequency_mhz"), 0, "greater than 0"),
        (("stages", 0, "instructions", 0, "instruction"), "recompute", "forward"),
        (("unit_time_s",), -1.0, "greater than 0"),
        (("surprise",), 1, "Extra inputs are not permitted"),
    ],
)
def test_bad_fields_are_rejected(path: tuple[Any, ...], value: Any, message: str) -> None:
    fields = _plan_fields()
    target = fields
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValidationError, match=message):
        PipelinePlan.model_validate(fields)
