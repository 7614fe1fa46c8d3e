"""A killed agent's locks and power limits are undone by the next start whatever else is wrong
with it, and one agent per state directory (subprocesses over emulated GPUs shared through their
state file). The plans set a power limit on every GPU (a power budget's backstop): each fault
below must give the GPUs their default limit back as it resets their clocks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from perseus_agent.clocks.reset_state import LOCK_FILENAME, STATE_FILENAME
from support.agent_process import (
    NODE,
    TIMEOUT_S,
    Agent,
    locked_clocks,
    plan_document,
    power_limits,
    source_env,
    wait_for,
)

pytest.importorskip("perseus_agent.gpu.emulated")

RESET_LINE = "reset the clocks of 2 GPU(s) left by a previous run: 0, 1"
LIMIT_W = 250.0
DEFAULT_LIMIT_W = 482.0  # the emulated A100's: the bundled profile's highest power, rounded up
HELD = ([1200, 1005], [LIMIT_W, LIMIT_W])
RESET = ([None, None], [DEFAULT_LIMIT_W, DEFAULT_LIMIT_W])


def gpus(agent: Agent) -> tuple[list[int | None], list[float]]:
    """The clocks and power limits of the agent's GPUs."""
    return agent.clocks(), power_limits(agent.gpu_state)


def limited_plan() -> dict[str, object]:
    return plan_document(power_limit_w=LIMIT_W)


def run_to_exit(
    agent: Agent, mode: list[str], socket_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run another agent on ``agent``'s GPUs and state directory, expecting it to exit."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "perseus_agent.main",
            "--gpu-backend=emulated",
            f"--emulated-gpus={agent.num_gpus}",
            f"--emulated-state-file={agent.gpu_state}",
            f"--node-name={NODE}",
            "--metrics-port=0",
            "--metrics-address=127.0.0.1",
            f"--socket-dir={socket_dir or agent.socket_dir}",
            f"--state-dir={agent.state_dir}",
            *mode,  # last: its flags win
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=source_env(),
        cwd=agent.workdir,
        timeout=TIMEOUT_S,
        check=False,
    )


def record(agent: Agent) -> list[int]:
    data = json.loads((agent.state_dir / STATE_FILENAME).read_text())
    return [g["index"] for g in data["gpus"]]


def kill_with_locked_clocks(agent: Agent) -> None:
    assert gpus(agent) == RESET
    agent.plan_file.write_text(json.dumps(limited_plan()))
    agent.start()
    wait_for(lambda: gpus(agent) == HELD, "the plan's clocks and power limits", agent)
    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
    assert gpus(agent) == HELD  # the hardware kept the locks and limits
    assert record(agent) == [0, 1]


# -- 1. recovery before any other start-up failure -----------------------------------------------


@pytest.mark.parametrize(
    ("plan_text", "message"),
    [
        ("{not json", "invalid plan file"),
        (json.dumps(plan_document(node="other-node")), "is for node 'other-node'"),
    ],
    ids=["invalid", "other-node"],
)
def test_restart_with_a_bad_plan_file_still_resets_the_killed_agents_clocks(
    agent: Agent, plan_text: str, message: str
) -> None:
    kill_with_locked_clocks(agent)
    agent.plan_file.write_text(plan_text)

    done = run_to_exit(agent, ["--standalone", f"--plan-file={agent.plan_file}"])

    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert RESET_LINE in done.stderr
    assert gpus(agent) == RESET
    assert record(agent) == []


def test_restart_without_its_plan_file_resets_the_killed_agents_clocks_and_waits(
    agent: Agent,
) -> None:
    """A standalone agent starts without its plan file (it applies one when it appears): the
    killed agent's locks are undone at start-up all the same, and no clock is set meanwhile."""
    kill_with_locked_clocks(agent)
    agent.plan_file.unlink()
    agent.start()
    wait_for(lambda: RESET_LINE in agent.log, "the reset of the killed agent's clocks", agent)
    assert gpus(agent) == RESET
    assert record(agent) == []
    assert agent.stop() == 0
    assert gpus(agent) == RESET


def test_restart_with_an_unloadable_kubeconfig_still_resets_the_killed_agents_clocks(
    agent: Agent, tmp_path: Path
) -> None:
    pytest.importorskip("kubernetes")
    kill_with_locked_clocks(agent)
    missing = tmp_path / "no-such-kubeconfig"

    done = run_to_exit(agent, [f"--kubeconfig={missing}"])

    assert done.returncode == 1, done.stderr
    assert f"cannot load the kubeconfig {missing}" in done.stderr
    assert RESET_LINE in done.stderr
    assert gpus(agent) == RESET
    assert record(agent) == []


def test_restart_on_a_taken_metrics_port_still_resets_the_killed_agents_clocks(
    agent: Agent,
) -> None:
    kill_with_locked_clocks(agent)
    agent.plan_file.write_text(json.dumps(plan_document(revision=2, gpus=())))
    blocker = Agent(agent.workdir / "other", agent.socket_dir.parent / "other")
    blocker.workdir.mkdir()
    blocker.plan_file.write_text(json.dumps(plan_document(gpus=())))
    blocker.start()
    try:
        done = run_to_exit(
            agent,
            ["--standalone", f"--plan-file={agent.plan_file}", f"--metrics-port={blocker.port}"],
        )
    finally:
        assert blocker.stop() == 0

    assert done.returncode == 1, done.stderr
    assert "cannot serve metrics" in done.stderr
    assert RESET_LINE in done.stderr
    assert gpus(agent) == RESET


# -- 2. one agent per state directory -----------------------------------------------------------


@pytest.mark.parametrize("same_socket_dir", [True, False], ids=["same-socket", "other-socket"])
def test_second_agent_on_the_same_state_dir_changes_nothing(
    agent: Agent, socket_dir: Path, same_socket_dir: bool
) -> None:
    agent.plan_file.write_text(json.dumps(limited_plan()))
    agent.start()
    wait_for(lambda: gpus(agent) == HELD, "the plan's clocks and power limits", agent)
    before = (agent.state_dir / STATE_FILENAME).read_bytes()

    other = None if same_socket_dir else socket_dir / "second"
    done = run_to_exit(agent, ["--standalone", f"--plan-file={agent.plan_file}"], other)

    assert done.returncode == 1, done.stderr
    assert "already holds state directory" in done.stderr
    assert f"(pid {agent.proc.pid if agent.proc else '?'})" in done.stderr
    assert "this one changed nothing" in done.stderr
    assert "reset the clocks" not in done.stderr
    assert gpus(agent) == HELD
    assert (agent.state_dir / STATE_FILENAME).read_bytes() == before
    assert agent.healthy() and (agent.socket_dir / "agent.sock").exists()
    if other is not None:
        assert not (other / "agent.sock").exists()

    # The first agent still knows its locks: SIGTERM resets them.
    assert agent.stop(signal.SIGTERM) == 0
    assert gpus(agent) == RESET
    assert record(agent) == []


def test_second_agent_with_a_bad_plan_leaves_the_running_agents_clocks_alone(
    agent: Agent,
) -> None:
    agent.plan_file.write_text(json.dumps(limited_plan()))
    agent.start()
    wait_for(lambda: gpus(agent) == HELD, "the plan's clocks and power limits", agent)
    bad = agent.workdir / "bad.json"
    bad.write_text("{not json")

    done = run_to_exit(agent, ["--standalone", f"--plan-file={bad}"])

    assert done.returncode == 2, done.stderr
    assert "leaving the clocks of its GPUs alone" in done.stderr
    assert gpus(agent) == HELD
    assert record(agent) == [0, 1]
    assert agent.stop(signal.SIGTERM) == 0


def test_the_lock_of_a_killed_agent_does_not_block_its_restart(agent: Agent) -> None:
    kill_with_locked_clocks(agent)
    assert (agent.state_dir / LOCK_FILENAME).exists()  # left behind, but nobody holds it
    agent.start()
    assert gpus(agent) == HELD  # the same plan again
    assert RESET_LINE in agent.log
    assert agent.stop(signal.SIGTERM) == 0
    assert locked_clocks(agent.gpu_state) == [None, None]
    assert power_limits(agent.gpu_state) == RESET[1]
