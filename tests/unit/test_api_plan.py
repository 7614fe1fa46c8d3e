"""The plan wire format rejects inconsistent plans and round-trips through JSON."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from perseus_api import Granularity, PipelinePlan, PlanObjective
from support.factories import pipeline_plan_fields


def test_valid_plan_round_trips_through_json() -> None:
    plan = PipelinePlan.model_validate(pipeline_plan_fields())
    assert plan.granularity is Granularity.INSTRUCTION
    assert plan.objective is PlanObjective.MIN_TIME
    assert plan.api_version == "perseus.energy/v1alpha1"
    again = PipelinePlan.model_validate_json(plan.model_dump_json())
    assert again == plan


def test_stages_must_be_complete_and_ordered() -> None:
    fields = pipeline_plan_fields()
    fields["stages"] = list(reversed(fields["stages"]))
    with pytest.raises(ValidationError, match=r"stages 0\.\.1 in order"):
        PipelinePlan.model_validate(fields)


def test_each_stage_lists_a_forward_and_backward_per_microbatch() -> None:
    fields = pipeline_plan_fields()
    fields["stages"][1]["instructions"].pop()
    with pytest.raises(ValidationError, match="stage 1 lists 3 computations, expected 4"):
        PipelinePlan.model_validate(fields)


def test_each_stage_lists_its_computations_in_schedule_order() -> None:
    fields = pipeline_plan_fields()
    swapped = fields["stages"][0]["instructions"]
    swapped[1], swapped[2] = swapped[2], swapped[1]  # F0 B0 F1 B1 instead of F0 F1 B0 B1
    with pytest.raises(
        ValidationError,
        match="stage 0 must list its computations in 1f1b order: computation 1 is backward of "
        "microbatch 0, expected forward of microbatch 1",
    ):
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
    fields = pipeline_plan_fields()
    target = fields
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValidationError, match=message):
        PipelinePlan.model_validate(fields)
