"""A stored profile is reused only for a job whose schedule plans from the same profile form
(one stage per GPU, ``P * V`` stages with virtual stages, split backwards for ZB-H1)."""

from __future__ import annotations

from typing import Any

from perseus_api.job import PerseusJobSpec
from perseus_operator.jobs.profile_source import pipeline_key


def spec(schedule: str, **parallelism: Any) -> PerseusJobSpec:
    return PerseusJobSpec.model_validate(
        {
            "workload": {"kind": "PyTorchJob", "name": "gpt3"},
            "parallelism": {
                "pipelineStages": 4,
                "microbatches": 8,
                "schedule": schedule,
                **parallelism,
            },
            "policy": {"mode": "Intrinsic", "granularity": "Instruction"},
        }
    )


def test_each_profile_form_has_its_own_key() -> None:
    one_per_gpu = pipeline_key(spec("1F1B"))
    assert one_per_gpu == "stages=4;clocks=default;step=15"  # as before: stored ones still fit
    assert pipeline_key(spec("GPipe")) == one_per_gpu  # the same profile form
    interleaved = pipeline_key(spec("Interleaved1F1B", virtualStages=2))
    assert interleaved == one_per_gpu + ";virtualStages=2"
    assert pipeline_key(spec("Interleaved1F1B", virtualStages=4)) != interleaved
    assert pipeline_key(spec("ZBH1")) == one_per_gpu + ";backward=split"
