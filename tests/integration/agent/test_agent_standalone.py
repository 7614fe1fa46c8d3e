"""The standalone agent's plan file: absent at start, a pipeline plan given by mistake, errors
that fit in a line, and the profile a profiling plan leaves beside it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from perseus_agent.main import main
from perseus_agent.modes.standalone_mode import merged_profile, profile_path
from perseus_api.node_report import GpuProfilingReport, ProfileRow
from support.agent_process import Agent, locked_clocks, plan_document, wait_for, write_atomically
from support.factories import pipeline_plan_fields

pytest.importorskip("perseus_agent.gpu.emulated")


def pipeline_plan_json() -> str:
    """What ``perseus plan`` writes as plan.json: a PipelinePlan, not a NodePlan."""
    return json.dumps({"kind": "PipelinePlan", **pipeline_plan_fields(2, 2)})


def test_the_agent_starts_without_its_plan_file_and_applies_it_when_it_appears(
    agent: Agent,
) -> None:
    assert not agent.plan_file.exists()
    agent.start()
    assert "plan file" in agent.log and "does not exist yet: waiting for it" in agent.log
    assert locked_clocks(agent.gpu_state) == [None, None]

    write_atomically(agent.plan_file, json.dumps(plan_document()))
    wait_for(lambda: locked_clocks(agent.gpu_state) == [1200, 1005], "the plan's clocks", agent)
    write_atomically(agent.plan_file, json.dumps(plan_document(revision=2, stage_mhz=(900, 1005))))
    wait_for(lambda: locked_clocks(agent.gpu_state) == [900, 1005], "the changed plan", agent)
    assert agent.stop(signal.SIGTERM) == 0
    assert locked_clocks(agent.gpu_state) == [None, None]


def test_a_pipeline_plan_at_start_up_says_what_to_run_instead(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(pipeline_plan_json())
    status = main(["--standalone", f"--plan-file={path}", "--node-name=n1"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1, err  # one line, not a page of validation errors
    assert f"plan file {path} holds a pipeline plan (perseus plan's plan.json), not a node " in err
    assert "perseus plan ... --gpus 0,1,... --node NODE" in err
    assert "node-plan-NODE.json" in err


def test_a_pipeline_plan_written_later_is_refused_in_one_line(agent: Agent) -> None:
    agent.start()
    write_atomically(agent.plan_file, pipeline_plan_json())
    wait_for(lambda: "holds a pipeline plan" in agent.log, "the refusal", agent)
    assert agent.metric("perseus_agent_apply_errors_total", reason="invalid_plan") == [1.0]
    refusal = next(line for line in agent.log.splitlines() if "holds a pipeline plan" in line)
    assert refusal.endswith("clocks reset, waiting for a valid plan")
    assert agent.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "invalid plan file {plan}: not JSON (Expecting property name"),
        (
            json.dumps(plan_document() | {"revision": -1}),
            "invalid plan file {plan}, 1 error: revision: Input should be greater than or "
            "equal to 0",
        ),
        (
            json.dumps({"kind": "NodePlan"}),
            "invalid plan file {plan}, 6 errors: node: Field required; job: Field required; "
            "revision: Field required (and 3 more)",
        ),
        (json.dumps({"kind": "PerseusJob"}), "plan file {plan} holds a PerseusJob, not a NodePlan"),
    ],
)
def test_a_bad_plan_file_is_named_in_one_line(
    content: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    assert main(["--standalone", f"--plan-file={path}", "--node-name=n1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message.format(plan=path) in err


Row = tuple[str, int, float, float, int]
"""instruction, clock (MHz), time (s), energy (J), samples"""


def _report(index: int, stage: int, rows: list[Row], **extra: float) -> GpuProfilingReport:
    return GpuProfilingReport(
        uuid=f"GPU-{index}",
        index=index,
        stage=stage,
        frequencies_mhz=[1410, 1005],
        applied_mhz=[1410, 1005],
        frequency_index=2,
        measured_iterations=4,
        dropped_iterations=0,
        done=True,
        rows=[
            ProfileRow(
                stage=stage, instruction=name, frequency_mhz=clock, time_s=t, energy_j=e, samples=n
            )
            for name, clock, t, e, n in rows
        ],
        blocking_power_w=extra.get("power_w"),
        blocking_s=extra.get("blocking_s", 0.0),
    )


def test_profiles_of_replicas_of_a_stage_are_merged_by_samples() -> None:
    # Two data-parallel replicas of stage 0 (GPUs 0 and 2) and stage 1 on GPU 1.
    reports = [
        _report(0, 0, [("forward", 1005, 0.2, 20.0, 4), ("forward", 1410, 0.1, 15.0, 4)],
                power_w=80.0, blocking_s=1.0),
        _report(2, 0, [("forward", 1410, 0.3, 25.0, 12)], power_w=90.0, blocking_s=3.0),
        _report(1, 1, [("backward", 1410, 0.5, 40.0, 2)]),
    ]  # fmt: skip
    rows, power_w = merged_profile(reports)
    got = [(r.stage, r.instruction, r.frequency_mhz, r.time_s, r.energy_j, r.samples) for r in rows]
    assert got == [
        (0, "forward", 1410, pytest.approx(0.25), pytest.approx(22.5), 16),
        (0, "forward", 1005, 0.2, 20.0, 4),
        (1, "backward", 1410, 0.5, 40.0, 2),
    ]
    assert power_w == pytest.approx(87.5)  # weighted by blocking time: (80 * 1 + 90 * 3) / 4


def test_the_profile_goes_beside_the_plan_file() -> None:
    assert profile_path(Path("/run/perseus/node-plan-n1.json")) == Path(
        "/run/perseus/node-plan-n1.profile.csv"
    )
