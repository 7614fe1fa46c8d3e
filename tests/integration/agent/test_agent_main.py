"""The ``perseus-node-agent`` command: flags, standalone plans, signals and crash recovery."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.main import main
from support.agent_process import (
    NODE,
    REPO_ROOT,
    TIMEOUT_S,
    Agent,
    locked_clocks,
    plan_document,
    wait_for,
    write_atomically,
)

emulated = pytest.importorskip("perseus_agent.gpu.emulated")


# -- usage errors (in process: nothing starts) -----------------------------------------------------


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_document()))
    return path


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(args)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["{plan}", "--node-name=n1"],
            "--plan-file needs --standalone (in Kubernetes mode the plans come from the API)",
        ),
        (["--kubeconfig=kc"], "no node name: pass --node-name or set $NODE_NAME"),
        (["--node-name=n1", "--report-interval=0"], "--report-interval must be a positive"),
        (["--node-name=n1", "--node-poll-interval=nan"], "--node-poll-interval must be a posit"),
        (["--standalone", "--node-name=n1"], "--standalone needs --plan-file"),
        (["--standalone", "{plan}"], "no node name: pass --node-name or set $NODE_NAME"),
        (["--standalone", "{plan}", "--node-name= "], "no node name"),
        (["--standalone", "{plan}", "--node-name=n1", "--metrics-port=70000"], "0..65535"),
        (
            [
                "--standalone",
                "{plan}",
                "--node-name=n1",
                "--gpu-backend=emulated",
                "--emulated-gpus=0",
            ],
            "--emulated-gpus must be at least 1, got 0",
        ),
        (
            ["--standalone", "{plan}", "--node-name=n1", "--emulated-gpus=2"],
            "--emulated-gpus needs --gpu-backend emulated",
        ),
        (
            [
                "--standalone",
                "{plan}",
                "--node-name=n1",
                "--gpu-backend=emulated",
                "--emulated-profile=p.csv",
            ],
            "--emulated-profile needs --emulated-blocking-power",
        ),
        (
            [
                "--standalone",
                "{plan}",
                "--node-name=n1",
                "--gpu-backend=emulated",
                "--emulated-blocking-power=-3",
            ],
            "--emulated-blocking-power must be a positive number",
        ),
        (
            ["--standalone", "{plan}", "--node-name=n1", "--gpu-backend=amd"],
            "invalid choice: 'amd'",
        ),
        (["--standalone", "{plan}", "--node-name=n1", "--metrics-port=http"], "invalid int value"),
        (
            ["--standalone", "{plan}", "--node-name=n2"],
            "is for node 'n1', but this agent runs on 'n2'",
        ),
    ],
)
def test_usage_errors_exit_2(
    args: list[str],
    message: str,
    plan_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    status, err = run_main([a.replace("{plan}", f"--plan-file={plan_file}") for a in args], capsys)
    assert status == 2
    assert err.startswith("usage: perseus-node-agent") or err.startswith(
        "perseus-node-agent: error: "
    )
    assert message in err


@pytest.mark.parametrize(
    ("kubeconfig", "message"),
    [
        (
            None,
            "cannot load the in-cluster configuration: ",
        ),
        ("{missing}", "cannot load the kubeconfig {missing}: "),
    ],
)
def test_kubernetes_mode_without_a_usable_configuration_exits_1(
    kubeconfig: str | None,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fatal before any GPU is touched; an API that is merely unreachable is retried instead
    (tests/integration/agent/test_kube.py)."""
    pytest.importorskip("kubernetes")
    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    missing = str(tmp_path / "no-such-kubeconfig")
    args = ["--node-name=n1", f"--state-dir={tmp_path / 'state'}"]
    if kubeconfig is not None:
        args.append(f"--kubeconfig={kubeconfig.format(missing=missing)}")
    status, err = run_main(args, capsys)
    assert status == 1
    assert err.startswith("perseus-node-agent: error: ")
    assert message.format(missing=missing) in err
    if kubeconfig is None:
        assert "pass --kubeconfig or --standalone" in err
    assert not (tmp_path / "state").exists()  # nothing started


def test_node_name_comes_from_the_environment(
    plan_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODE_NAME", "n2")
    status, err = run_main(["--standalone", f"--plan-file={plan_file}"], capsys)
    assert status == 2
    assert "this agent runs on 'n2'" in err  # got past the node name check


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # A plan file that is not there yet is waited for (test_agent_standalone.py).
        (None, "cannot read plan file {plan}: Is a directory"),
        ("{not json", "invalid plan file {plan}: not JSON"),
        (
            json.dumps(plan_document() | {"revision": -1}),
            "invalid plan file {plan}, 1 error: revision: Input should be greater than or "
            "equal to 0",
        ),
    ],
)
def test_bad_plan_file_at_start_up_exits_2(
    content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    else:
        path.mkdir()
    status, err = run_main(["--standalone", f"--plan-file={path}", "--node-name=n1"], capsys)
    assert status == 2
    assert err.startswith("perseus-node-agent: error: ")
    assert message.format(plan=path) in err


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--gpu-backend",
        "--emulated-gpus",
        "--emulated-profile",
        "--emulated-blocking-power",
        "--emulated-state-file",
        "--node-name",
        "--metrics-port",
        "--metrics-address",
        "--socket-dir",
        "--state-dir",
        "--standalone",
        "--plan-file",
        "--kubeconfig",
        "--report-interval",
        "--gpu-ownership",
        "--pod-resources-socket",
        "--node-poll-interval",
        "--foreign-clocks",
        "--log-level",
    ):
        assert flag in out


def test_gpu_ownership_is_the_kubelets_unless_said_otherwise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from perseus_agent.main import build_parser
    from perseus_agent.modes.agent_config import check_args
    from perseus_agent.modes.kubernetes_mode import choose_ownership
    from perseus_agent.ownership.gpu_ownership import KubeletOwnership, LocalRankIndexOwnership

    monkeypatch.delenv("PERSEUS_GPU_OWNERSHIP", raising=False)
    monkeypatch.delenv("PERSEUS_POD_RESOURCES_SOCKET", raising=False)
    config = check_args(build_parser().parse_args(["--node-name=n1"]))
    assert config.gpu_ownership == "kubelet"
    assert str(config.pod_resources_socket) == "/var/lib/kubelet/pod-resources/kubelet.sock"
    missing = tmp_path / "kubelet.sock"
    args = ["--node-name=n1", f"--pod-resources-socket={missing}"]
    ownership = choose_ownership(check_args(build_parser().parse_args(args)))
    assert isinstance(ownership, KubeletOwnership)
    assert f"PodResources socket {missing} does not exist" in caplog.text  # said at start-up
    monkeypatch.setenv("PERSEUS_GPU_OWNERSHIP", "local-rank-index")
    config = check_args(build_parser().parse_args(["--node-name=n1"]))
    assert isinstance(choose_ownership(config), LocalRankIndexOwnership)
    assert main(["--node-name=n1", "--gpu-ownership=index"]) == 2


def test_bad_emulated_profile_exits_2(tmp_path: Path, plan_file: Path) -> None:
    profile = tmp_path / "bad.csv"
    profile.write_text("stage,instruction\n0,forward\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "operator"), str(REPO_ROOT / "node_agent")]
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "perseus_agent.main",
            "--standalone",
            f"--plan-file={plan_file}",
            f"--node-name={NODE}",
            "--gpu-backend=emulated",
            f"--emulated-profile={profile}",
            "--emulated-blocking-power=80",
            f"--state-dir={tmp_path / 'state'}",
            "--metrics-port=0",
            "--metrics-address=127.0.0.1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert f"perseus-node-agent: error: --emulated-profile {profile}: " in result.stderr


# -- standalone agent over emulated GPUs (subprocesses) --------------------------------------------


def test_standalone_agent_applies_the_plan_and_resets_on_sigterm(agent: Agent) -> None:
    agent.plan_file.write_text(json.dumps(plan_document()))
    agent.start()

    wait_for(lambda: locked_clocks(agent.gpu_state) == [1200, 1005], "the plan's clocks", agent)
    assert (agent.socket_dir / "agent.sock").exists()
    labels = {
        "node": NODE,
        "gpu": "1",
        "uuid": f"GPU-emu-{NODE}-1",
        "job_name": "gpt3",
        "pp_rank": "1",
    }
    assert agent.metric("perseus_gpu_target_sm_clock_hertz", **labels) == [1.005e9]
    assert agent.metric("perseus_gpu_sm_clock_hertz", **labels) == [1.005e9]
    assert agent.metric("perseus_gpu_energy_joules_total", gpu="0")[0] >= 0.0
    record = json.loads((agent.state_dir / "reset-state.json").read_text())
    assert [g["index"] for g in record["gpus"]] == [0, 1]

    assert agent.stop(signal.SIGTERM) == 0

    assert locked_clocks(agent.gpu_state) == [None, None]
    assert json.loads((agent.state_dir / "reset-state.json").read_text())["gpus"] == []
    assert not (agent.socket_dir / "agent.sock").exists()
    assert "every clock this agent changed is reset" in agent.log


def test_sigint_also_resets_the_clocks(agent: Agent) -> None:
    agent.plan_file.write_text(json.dumps(plan_document(gpus=(1,))))
    agent.start()
    wait_for(lambda: locked_clocks(agent.gpu_state) == [None, 1005], "the plan's clocks", agent)
    assert agent.stop(signal.SIGINT) == 0
    assert locked_clocks(agent.gpu_state) == [None, None]


def test_restarted_agent_resets_the_clocks_a_killed_one_left_locked(agent: Agent) -> None:
    agent.plan_file.write_text(json.dumps(plan_document()))
    agent.start()
    wait_for(lambda: locked_clocks(agent.gpu_state) == [1200, 1005], "the plan's clocks", agent)

    assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
    assert locked_clocks(agent.gpu_state) == [1200, 1005]  # the hardware kept the locks

    # The new plan manages no GPU: only the recovery can unlock them.
    write_atomically(agent.plan_file, json.dumps(plan_document(revision=2, gpus=())))
    agent.start()

    assert locked_clocks(agent.gpu_state) == [None, None]
    assert "reset the clocks of 2 GPU(s) left by a previous run: 0, 1" in agent.log
    assert agent.stop(signal.SIGTERM) == 0


def test_bad_plan_is_reported_and_the_agent_keeps_running(agent: Agent) -> None:
    agent.plan_file.write_text(json.dumps(plan_document()))
    agent.start()
    wait_for(lambda: locked_clocks(agent.gpu_state) == [1200, 1005], "the plan's clocks", agent)

    write_atomically(agent.plan_file, '{"node": "n1", "job": ')
    wait_for(lambda: locked_clocks(agent.gpu_state) == [None, None], "the reset", agent)
    assert agent.proc is not None and agent.proc.poll() is None
    assert agent.healthy()
    assert "invalid plan file" in agent.log
    assert agent.metric("perseus_agent_apply_errors_total", reason="invalid_plan") == [1.0]

    write_atomically(agent.plan_file, json.dumps(plan_document(revision=2, stage_mhz=(900, 1005))))
    wait_for(lambda: locked_clocks(agent.gpu_state) == [900, 1005], "the new plan", agent)

    write_atomically(agent.plan_file, json.dumps(plan_document(revision=3, node="n9")))
    wait_for(lambda: locked_clocks(agent.gpu_state) == [None, None], "the reset", agent)
    assert "is for node 'n9'" in agent.log

    write_atomically(agent.plan_file, json.dumps(plan_document(revision=4)))
    wait_for(lambda: locked_clocks(agent.gpu_state) == [1200, 1005], "the plan again", agent)
    agent.plan_file.unlink()
    wait_for(lambda: locked_clocks(agent.gpu_state) == [None, None], "the plan's removal", agent)
    assert "plan file" in agent.log and "removed" in agent.log
    assert agent.metric("perseus_agent_apply_errors_total", reason="invalid_plan") == [2.0]

    assert agent.stop(signal.SIGTERM) == 0


def test_training_process_switches_clocks_and_sigterm_resets_them(agent: Agent) -> None:
    agent.plan_file.write_text(json.dumps(plan_document(granularity="Instruction")))
    agent.start()
    assert locked_clocks(agent.gpu_state) == [None, None]  # nothing until training calls in

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(agent.socket_dir / "agent.sock"))
        stream = sock.makefile("rwb")

        def call(msg: dict[str, Any]) -> dict[str, Any]:
            stream.write(json.dumps(msg).encode() + b"\n")
            stream.flush()
            reply: dict[str, Any] = json.loads(stream.readline())
            assert reply["ok"] is True, reply
            return reply

        hello = {
            "op": "hello",
            "version": 1,
            "rank": 0,
            "local_rank": 0,
            "gpu_uuids": [f"GPU-emu-{NODE}-0"],
            "pid": os.getpid(),
            "job": "gpt3",
            "namespace": "ml",
            "pod": None,
        }
        assert call(hello)["managed"] is True
        call({"op": "step_begin", "step": 0})
        first = call({"op": "instruction_begin", "name": "forward", "microbatch": 0})
        assert first["sm_clock_mhz"] == 1110
        assert locked_clocks(agent.gpu_state) == [1110, None]
        second = call({"op": "instruction_begin", "name": "backward", "microbatch": 0})
        assert second["sm_clock_mhz"] == 1200
        call({"op": "step_end", "step": 0})
        count = agent.metric("perseus_iteration_seconds_count", rank="0", gpu="0", job_name="gpt3")
        assert count == [1.0]

        assert agent.stop(signal.SIGTERM) == 0  # with the training process still connected
        assert stream.readline() == b""  # the agent closed the connection
    assert locked_clocks(agent.gpu_state) == [None, None]


@pytest.mark.parametrize("pipelined", [False, True])
def test_pipelined_client_drives_the_plan_like_a_synchronous_one(
    agent: Agent, pipelined: bool
) -> None:
    """Hooks sent without waiting for replies are applied in order: the same clocks, the same
    iteration count, no schedule mismatch."""
    from perseus_client import PerseusClient

    agent.plan_file.write_text(json.dumps(plan_document(granularity="Instruction")))
    agent.start()
    wait_for((agent.socket_dir / "agent.sock").exists, "the local socket", agent)
    client = PerseusClient(
        agent.socket_dir / "agent.sock",
        rank=0,
        gpu_uuids=[f"GPU-emu-{NODE}-0"],
        job="gpt3",
        namespace="ml",
        connect_timeout_s=5,
        reply_timeout_s=5,
        pipelined=pipelined,
    )
    steps = 20
    with client:
        for step in range(steps):
            with client.step(step):
                # Stage 0 of 1F1B with 2 stages and 2 microbatches.
                for name, microbatch in (("forward", 0), ("forward", 1), ("backward", 0)):
                    with client.instruction(name, microbatch):
                        pass
                clock = client.on_instruction_begin("backward", 1)
                assert clock == (None if pipelined else 1200)
                client.on_instruction_end("backward")
        assert client.flush()
        assert locked_clocks(agent.gpu_state) == [1200, None]  # backward 1 of the last step
        assert client.connections == 1
    wait_for(lambda: locked_clocks(agent.gpu_state) == [None, None], "the reset", agent)
    count = agent.metric("perseus_iteration_seconds_count", rank="0", gpu="0", job_name="gpt3")
    assert count == [float(steps)]
    # Forward 0 runs at 1110 MHz, the rest at 1200: two changes per step, plus the reset
    # when the training process went away.
    assert agent.metric("perseus_gpu_clock_changes_total", gpu="0") == [2.0 * steps + 1]
    errors = [
        line
        for line in agent.get("/metrics").splitlines()
        if line.startswith("perseus_agent_apply_errors_total") and not line.endswith(" 0.0")
    ]
    assert errors == []  # no schedule mismatch, nothing else
    assert agent.stop() == 0
