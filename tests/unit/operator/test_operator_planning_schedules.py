"""The operator plans Interleaved1F1B (with virtualStages) and ZBH1 jobs end to end."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from perseus_api import Granularity
from perseus_api.job import PerseusJobSpec, Policy, ScheduleName
from perseus_api.profile import Profile
from perseus_api.schedule import Schedule, gpu_computation_order
from perseus_operator.jobs.phase_decisions import profiling_placeholder_plan
from perseus_operator.jobs.planning import PlanningInput, choose_plan, solve_frontier
from perseus_planner import DEFAULT_PROFILE, bundled_profile, split_backward, split_virtual_stages

REPO = Path(__file__).resolve().parents[3]
STAGES, MICROBATCHES = 4, 8


def _csv(profile: Profile) -> str:
    lines = ["stage,instruction,frequency,time,energy"]
    for (stage, instruction), m in profile.measurements.items():
        for f, t, e in zip(m.frequencies_mhz, m.times_s, m.energies_j, strict=True):
            lines.append(f"{stage},{instruction},{int(f)},{float(t)!r},{float(e)!r}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def four_stages() -> Profile:
    """The bundled GPT-3 / A100 profile's first four stages."""
    full = bundled_profile(DEFAULT_PROFILE).load()
    kept = {k: m for k, m in full.measurements.items() if k[0] < STAGES}
    return Profile("gpt3-4-stages", STAGES, kept)


def _spec(schedule: str, virtual_stages: int) -> PerseusJobSpec:
    raw: dict[str, Any] = copy.deepcopy(
        yaml.safe_load((REPO / "crds" / "samples" / "perseusjob-minimal.yaml").read_text())["spec"]
    )
    raw["parallelism"].update(
        pipelineStages=STAGES,
        microbatches=MICROBATCHES,
        schedule=schedule,
        virtualStages=virtual_stages,
    )
    return PerseusJobSpec.model_validate(raw)


@pytest.mark.parametrize(
    ("schedule", "virtual_stages"),
    [(ScheduleName.INTERLEAVED_1F1B, 2), (ScheduleName.ZBH1, 1)],
)
def test_solve_and_plan(four_stages: Profile, schedule: ScheduleName, virtual_stages: int) -> None:
    if schedule is ScheduleName.INTERLEAVED_1F1B:
        profile = split_virtual_stages(four_stages, virtual_stages)
    else:
        profile = split_backward(four_stages)
    request = PlanningInput(
        profile_csv=_csv(profile),
        profile_source="derived",
        schedule=schedule,
        num_stages=STAGES,
        num_microbatches=MICROBATCHES,
        blocking_power_w=bundled_profile(DEFAULT_PROFILE).blocking_power_w,
        virtual_stages=virtual_stages,
    )
    frontier = solve_frontier(request)
    dag = frontier.problem.dag
    assert (dag.num_stages, dag.virtual_stages) == (STAGES, virtual_stages)
    assert (dag.num_microbatches, dag.schedule) == (MICROBATCHES, Schedule.parse(schedule.value))
    spec = _spec(schedule.value, virtual_stages)
    plan = choose_plan(frontier, Policy(granularity=Granularity.INSTRUCTION))
    assert plan.virtual_stages == virtual_stages
    assert 0 < plan.estimate.savings_ratio < 0.5
    placeholder = profiling_placeholder_plan(spec)
    assert placeholder.schedule == plan.schedule
    for stage in placeholder.stages:
        steps = gpu_computation_order(
            plan.schedule, STAGES, MICROBATCHES, stage.stage, virtual_stages
        )
        assert [(i.instruction, i.microbatch) for i in stage.instructions] == [
            (s.instruction, s.microbatch) for s in steps
        ]


def test_a_per_gpu_profile_for_an_interleaved_job_names_the_layout(four_stages: Profile) -> None:
    request = PlanningInput(
        profile_csv=_csv(four_stages),
        profile_source="per-gpu",
        schedule=ScheduleName.INTERLEAVED_1F1B,
        num_stages=STAGES,
        num_microbatches=MICROBATCHES,
        blocking_power_w=80.0,
        virtual_stages=2,
    )
    with pytest.raises(ValueError, match=r"needs 8 \(virtual stage v\*4\+p runs on GPU p\)"):
        solve_frontier(request)
