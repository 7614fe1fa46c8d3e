"""docs/user-guide/standalone.md's recipe, end to end without Kubernetes: a standalone agent
started with no plan file, ``perseus profile-plan``, real torch processes
(``examples/torch_pipeline.py``) profiled on emulated GPUs, ``perseus plan`` from that profile
to a node plan, and the example measuring the plan's savings against all max clock through the
agent's metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from perseus_api import PipelinePlan
from support.agent_process import NODE, PROFILE, Agent, source_env, wait_for
from support.torch_job import REPO_ROOT, require_torch, run_example

STAGES, MICROBATCHES = 2, 4
CLOCKS = "1410,1200,1005"  # supported by the emulated A100s
WARMUP, MEASURED = 1, 2
SWEEP_STEPS = 3 * (WARMUP + MEASURED) + 2
BASELINE_STEPS, STEPS = 5, 12
SAVINGS_TOLERANCE_PP = 2.5
"""Measured (at equal iteration time) vs planned savings, percentage points. Emulated GPUs
realize the profile's rows (the plan's replayed estimate); each step also waits on the host.
The equal-time comparison charges those waits to both phases at blocking power, but a stall
inside a computation costs busy power, so a loaded host still lowers the measured figure.
Seen on the shared 2-core machine (load average 9-22), planned 3.71 %: 3.8 % and 2.2 % at
equal time (raw energy per iteration: 3.7, 1.0, 3.5 and 1.0 % over four runs)."""
DOC = REPO_ROOT / "docs" / "user-guide" / "standalone.md"


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    require_torch()
    socket_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="psrc-"))
    agent = Agent(tmp_path, socket_dir / "run", num_gpus=STAGES, log_level="info")
    yield agent
    agent.kill_if_running()
    shutil.rmtree(socket_dir, ignore_errors=True)


def perseus(*args: str | Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "perseus_cli.main", *map(str, args)],
        env=source_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def install(plan: Path, plan_file: Path) -> None:
    """As the doc says: a temporary name, then renamed over the agent's plan file."""
    tmp = plan_file.with_name(".plan.tmp")
    shutil.copyfile(plan, tmp)
    tmp.replace(plan_file)


def emulation(agent: Agent) -> list[str]:
    """The example's stages on the agent's emulated GPUs (rank r on GPU r)."""
    return [
        *("--pp", str(STAGES), "--microbatches", str(MICROBATCHES)),
        *("--emulated-gpus", str(agent.gpu_state), "--emulated-profile", str(PROFILE)),
        *("--node-name", NODE),
    ]


def test_the_doc_names_the_commands_this_test_runs() -> None:
    doc = DOC.read_text()
    for command in (
        "perseus-node-agent --standalone --node-name",
        "perseus profile-plan --stages 4 --microbatches 8 --ranks ranks.csv",
        "--clocks 1410,1200,1005",
        "perseus plan --profile profile.csv --blocking-power",
        "cp PLAN /run/perseus/.plan.tmp && mv /run/perseus/.plan.tmp /run/perseus/plan.json",
        "/run/perseus/plan.profile.csv",
        "--steps 12 --baseline-steps 5",
        "--agent-metrics http://127.0.0.1:7461/metrics",
    ):
        assert command in doc, command


def test_profile_plan_and_train_without_kubernetes(agent: Agent, tmp_path: Path) -> None:
    # 1. The agent starts before any plan exists.
    agent.start()
    assert "does not exist yet: waiting for it" in agent.log

    # 3. A profiling plan, the job trained through the sweep, the profile beside the plan file.
    perseus(
        "profile-plan", "--stages", STAGES, "--microbatches", MICROBATCHES, "--gpus", "0,1",
        "--node", NODE, "--clocks", CLOCKS, "--iterations-per-frequency", MEASURED,
        "--warmup-iterations", WARMUP, "--out", tmp_path / "profiling",
    )  # fmt: skip
    install(tmp_path / "profiling" / f"node-plan-{NODE}.json", agent.plan_file)
    wait_for(lambda: agent.log.count("applied plan") == 1, "the profiling plan", agent)
    run_example([*emulation(agent), "--steps", str(SWEEP_STEPS)],
                socket_path=agent.socket_dir / "agent.sock")  # fmt: skip
    profile = agent.plan_file.with_name("plan.profile.csv")
    wait_for(profile.exists, "the profile beside the plan file", agent)
    logged = re.search(r"blocking power ([0-9.]+) W: plan with `perseus plan --profile", agent.log)
    assert logged is not None, agent.log
    rows = profile.read_text().splitlines()
    assert rows[0] == "stage,instruction,frequency,time,energy"
    assert len(rows) == 1 + STAGES * 2 * 3  # forward and backward at 3 clocks per stage

    # 4. The plan from that profile, as a node plan for this node.
    perseus(
        "plan", "--profile", profile, "--blocking-power", logged.group(1),
        "--microbatches", MICROBATCHES, "--gpus", "0,1", "--node", NODE,
        "--out", tmp_path / "plan", "--no-plot",
    )  # fmt: skip
    planned = PipelinePlan.model_validate_json((tmp_path / "plan" / "plan.json").read_text())
    planned_percent = 100 * planned.instruction_estimate.savings_ratio
    assert planned_percent > 1.0
    install(tmp_path / "plan" / f"node-plan-{NODE}.json", agent.plan_file)
    wait_for(lambda: agent.log.count("applied plan") == 2, "the plan", agent)

    # 5. Training: all max clock first (no hooks yet), then under the plan; the example says
    # what it measured.
    done = run_example(
        [
            *emulation(agent), "--steps", str(STEPS), "--baseline-steps", str(BASELINE_STEPS),
            "--agent-metrics", f"http://127.0.0.1:{agent.port}/metrics",
        ],
        socket_path=agent.socket_dir / "agent.sock",
    )  # fmt: skip
    steps = re.findall(rf"^step (\d+)/{STEPS}: [0-9.]+ s( \(all max\))?$", done.stdout, re.M)
    assert [int(n) for n, _ in steps] == list(range(1, STEPS + 1)), done.stdout
    assert [bool(m) for _, m in steps] == [True] * BASELINE_STEPS + [False] * (
        STEPS - BASELINE_STEPS
    )
    assert re.search(r"^Perseus +[0-9.]+ s +[0-9.]+ J per iteration$", done.stdout, re.MULTILINE)
    assert re.search(r"^all max clock +[0-9.]+ s +[0-9.]+ J per iteration$", done.stdout,
                     re.MULTILINE), done.stdout  # fmt: skip
    assert re.search(r"^saved +-?[0-9.]+ % energy per iteration, time [-+][0-9.]+ %$",
                     done.stdout, re.MULTILINE), done.stdout  # fmt: skip
    saved = re.search(r"^at equal time +(-?[0-9.]+) % saved, both iterations", done.stdout, re.M)
    assert saved is not None, done.stdout
    measured_percent = float(saved.group(1))
    print(done.stdout, f"planned {planned_percent:.2f} %")  # shown with -s: the spread
    assert measured_percent > 0.5, (done.stdout, planned_percent)
    assert measured_percent == pytest.approx(planned_percent, abs=SAVINGS_TOLERANCE_PP), (
        done.stdout,
        planned_percent,
    )
    assert agent.metric("perseus_agent_apply_errors_total", reason="schedule_mismatch") in (
        [],
        [0.0],
    ), agent.log
