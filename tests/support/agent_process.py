"""A standalone ``perseus-node-agent`` process over emulated GPUs, and its plan file, for tests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from support.factories import pipeline_plan_fields
from support.image_process import image_command, kubeconfig_files

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE = REPO_ROOT / "operator" / "perseus_planner" / "profiles" / "gpt3-175b+a100_sxm_bf16.csv"
NODE = "n1"
NUM_GPUS = 2
TIMEOUT_S = 20.0
# An agent's start (the interpreter, its imports, the first GPU reads): ~2 s quiet; a
# power-budget e2e run with a core kept busy and the load average at ~10 (other sessions'
# tests) saw the first of three agents print nothing in 20 s.
START_TIMEOUT_S = 60.0


def source_env() -> dict[str, str]:
    """Environment for a subprocess that imports the project from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT / "operator"), str(REPO_ROOT / "node_agent")]
    )
    env.pop("NODE_NAME", None)
    return env


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_for(
    condition: Callable[[], bool],
    what: str,
    agent: Agent | None = None,
    timeout_s: float = TIMEOUT_S,
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if agent is not None and agent.proc is not None and agent.proc.poll() is not None:
            pytest.fail(f"agent exited ({agent.proc.returncode}) waiting for {what}:\n{agent.log}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}" + (f":\n{agent.log}" if agent else ""))


def locked_clocks(gpu_state: Path, num_gpus: int = NUM_GPUS, node: str = NODE) -> list[int | None]:
    """The SM clock lock of each emulated GPU, read from the shared hardware state."""
    from perseus_agent.gpu.emulated import EmulatedBackend

    gpus = EmulatedBackend.from_csv(
        num_gpus, PROFILE, blocking_power_w=83.64, node_name=node, state_file=gpu_state
    )
    return [gpus.locked_sm_clock_mhz(i) for i in range(num_gpus)]


def power_limits(gpu_state: Path, num_gpus: int = NUM_GPUS, node: str = NODE) -> list[float]:
    """The power limit in force on each emulated GPU, read from the shared hardware state."""
    from perseus_agent.gpu.emulated import EmulatedBackend

    gpus = EmulatedBackend.from_csv(
        num_gpus, PROFILE, blocking_power_w=83.64, node_name=node, state_file=gpu_state
    )
    try:
        return [gpus.power_limit_w(i) for i in range(num_gpus)]
    finally:
        gpus.close()


def plan_document(
    *,
    revision: int = 1,
    granularity: str = "Stage",
    stage_mhz: tuple[int, int] = (1200, 1005),
    gpus: tuple[int, ...] = (0, 1),
    node: str = NODE,
    power_limit_w: float | None = None,
) -> dict[str, Any]:
    """A plan file for the agent on ``node``: two stages, two microbatches, a rank on each of
    ``gpus`` (with ``power_limit_w``, each GPU's power limit)."""
    fields = pipeline_plan_fields(num_stages=2, num_microbatches=2)
    for stage in fields["stages"]:
        stage["frequency_mhz"] = stage_mhz[stage["stage"]]
        stage["instructions"][0]["frequency_mhz"] = 1110  # forward of microbatch 0
    return {
        "node": node,
        "namespace": "ml",
        "job": "gpt3",
        "revision": revision,
        "granularity": granularity,
        "plans": {"tmin": fields},
        "assignments": [
            # GPU 0 by UUID, the others by index.
            {"gpu_uuid": f"GPU-emu-{node}-{i}", "plan": "tmin", "stage": i % 2, "rank": i}
            if i == 0
            else {"gpu_index": i, "plan": "tmin", "stage": i % 2, "rank": i}
            for i in gpus
        ]
        if power_limit_w is None
        else [
            {
                "gpu_index": i,
                "plan": "tmin",
                "stage": i % 2,
                "rank": i,
                "powerLimitWatts": power_limit_w,
            }
            for i in gpus
        ],
    }


class Agent:
    """One ``perseus-node-agent`` process over emulated GPUs: standalone on ``plan_file``, or
    in Kubernetes mode when given a kubeconfig."""

    def __init__(
        self,
        workdir: Path,
        socket_dir: Path,
        num_gpus: int = NUM_GPUS,
        kubeconfig: Path | None = None,
        node: str = NODE,
        log_level: str = "debug",
        pod_resources_socket: Path | None = None,
        emulated_profile: tuple[Path, float] | None = None,
        tcp: bool = False,
        image: Mapping[str, Any] | None = None,
    ) -> None:
        """In Kubernetes mode the agent asks the kubelet stand-in on ``pod_resources_socket``
        which GPUs the pods own; without one, ``--gpu-ownership=local-rank-index`` (there is no
        kubelet: a pod's local rank r runs on GPU index r). ``tcp``: it also listens on
        127.0.0.1 (a free port: :attr:`tcp_port`) for the pods of the API's pod list.
        ``image``: run the built node agent image's entrypoint from its root filesystem
        (support.image_process) instead of the sources."""
        self.image = image
        self.tcp = tcp
        self.tcp_port: int | None = None
        self.num_gpus = num_gpus
        self.emulated_profile = emulated_profile
        """The emulated GPUs' profile CSV and blocking power (``None``: the bundled one)."""
        self.pod_resources_socket = pod_resources_socket
        self.node = node
        self.log_level = log_level
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.socket_dir = socket_dir
        self.plan_file = workdir / "plan.json"
        self.gpu_state = workdir / "gpus.json"  # the emulated hardware, outlives the agent
        self.state_dir = workdir / "state"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_file = workdir / "agent-0.log"
        self.starts = 0
        self.port: int | None = None
        self.metrics_port = 0
        """Of the next start; 0: any free one (found in the log as :attr:`port`)."""

    @property
    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else ""

    def clocks(self) -> list[int | None]:
        return locked_clocks(self.gpu_state, self.num_gpus, self.node)

    def start(self) -> None:
        self.starts += 1
        self.log_file = self.workdir / f"agent-{self.starts}.log"
        env = source_env()
        mode = (
            ["--standalone", f"--plan-file={self.plan_file}"]
            if self.kubeconfig is None
            else [
                f"--kubeconfig={self.kubeconfig}",
                "--report-interval=0.2",
                "--gpu-ownership=local-rank-index"
                if self.pod_resources_socket is None
                else f"--pod-resources-socket={self.pod_resources_socket}",
                *([f"--tcp-address=127.0.0.1:{self.tcp_port or 0}"] if self.tcp else []),
            ]
        )
        emulated_profile = self.emulated_profile
        args = [
            *mode,
            "--gpu-backend=emulated",
            f"--emulated-gpus={self.num_gpus}",
            f"--emulated-state-file={self.gpu_state}",
            f"--node-name={self.node}",
            f"--metrics-port={self.metrics_port}",
            "--metrics-address=127.0.0.1",
            f"--socket-dir={self.socket_dir}",
            f"--state-dir={self.state_dir}",
            f"--log-level={self.log_level}",
            *(
                [
                    f"--emulated-profile={emulated_profile[0]}",
                    f"--emulated-blocking-power={emulated_profile[1]}",
                ]
                if emulated_profile is not None
                else []
            ),
        ]
        if self.image is None:
            argv = [sys.executable, "-m", "perseus_agent.main", *args]
        else:
            host_paths = [self.workdir, self.socket_dir, *self._pod_resources_dir()]
            argv, env = image_command(
                self.image,
                args,
                scratch=self.workdir / f"rootfs-{self.starts}",
                env={},
                shared=[
                    *(kubeconfig_files(self.kubeconfig) if self.kubeconfig else []),
                    *([emulated_profile[0]] if emulated_profile else []),
                ],
                writable=host_paths,
            )
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
            )
        pattern = re.compile(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics")
        tcp_pattern = re.compile(r"serving training processes on tcp://127\.0\.0\.1:(\d+)")

        def started() -> bool:
            match = pattern.search(self.log)
            if match:
                self.port = int(match.group(1))
            if self.tcp:
                tcp_match = tcp_pattern.search(self.log)
                if tcp_match is None:
                    return False
                self.tcp_port = int(tcp_match.group(1))
            return match is not None and self.healthy()

        wait_for(started, "the agent to start", self, START_TIMEOUT_S)

    def _pod_resources_dir(self) -> list[Path]:
        return [] if self.pod_resources_socket is None else [self.pod_resources_socket.parent]

    def healthy(self) -> bool:
        try:
            return self.get("/healthz") == "ok\n"
        except (OSError, urllib.error.URLError):
            return False

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            body: bytes = r.read()
            return body.decode()

    def metric(self, name: str, **labels: str) -> list[float]:
        values = []
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                values.append(float(line.rsplit(" ", 1)[1]))
        return values

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        finally:
            self.proc = None

    def kill_if_running(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=TIMEOUT_S)
        self.proc = None


def run_emulated_rank(
    agent: Agent,
    *,
    stage: int,
    stages: int,
    microbatches: int,
    steps: int,
    time_scale: float,
    blocking_power_w: float,
    bubble_s: float = 0.0,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Run ``python -m perseus_emulation.rank`` as rank 0 on the agent's GPU 0; return
    what it printed (``step_times_s``, ``busy_s``)."""
    done = subprocess.run(
        [
            sys.executable, "-m", "perseus_emulation.rank",
            f"--state-file={agent.gpu_state}", f"--num-gpus={agent.num_gpus}",
            f"--node-name={NODE}", f"--profile={PROFILE}",
            f"--blocking-power={blocking_power_w}", f"--stage={stage}", f"--stages={stages}",
            f"--microbatches={microbatches}", f"--steps={steps}", "--rank=0",
            f"--socket={agent.socket_dir / 'agent.sock'}", f"--time-scale={time_scale}",
            f"--bubble-s={bubble_s}",
        ],
        env=source_env(),
        check=True,
        capture_output=True,
        timeout=timeout_s,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result
