"""Real torch training managed end to end: the operator on a real kube-apiserver, node agents
in Kubernetes mode on emulated GPUs, and real ``torch.distributed.pipelining`` processes
(2 replicas x 2 stages, gloo, ``examples/torch_pipeline.py``) attached with
``perseus_client.torch``.

Each replica runs on its own node; each rank's stage computes on its node's emulated GPU,
padded to the profile's time at the clock its agent locked (``perseus_emulation.torch_stage``),
so the plan changes how long the real processes take. One scenario, as a user meets it:
profiling measured from the real processes, the Instruction plan applied computation by
computation (no ``schedule_mismatch``), then one node's GPUs slowed: the straggler replica is
detected and the healthy one re-targeted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import pytest

from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api import resources
from perseus_api.profile import parse_profile
from perseus_operator.jobs.phase_decisions import profile_config_map_name
from perseus_operator.jobs.profile_source import PROFILE_KEY
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from perseus_operator.workloads.pods import (
    GPU_RESOURCE,
    PYTORCH_JOB_NAME,
    PYTORCH_REPLICA_INDEX,
    PYTORCH_REPLICA_TYPE,
)
from support.agent_process import Agent, source_env
from support.cluster_harness import Cluster
from support.operator_harness import OperatorProcess, cut_profile
from support.torch_job import EXAMPLE, require_torch

NAMESPACE = "torch"
JOB = "tiny"
STAGES, REPLICAS, MICROBATCHES = 2, 2, 4
NODES = [f"torch-node-{i}" for i in range(REPLICAS)]  # replica k on node k
BLOCKING_W = 83.64
TIME_SCALE = 0.5  # computations of ~25-60 ms at the highest clock
TIMEOUT_S = 300.0
SLOWDOWN = 1.2


def pytorch_job() -> dict[str, Any]:
    replica = {
        "replicas": 1,
        "template": {"spec": {"containers": [{"name": PYTORCH_CONTAINER, "image": "trainer"}]}},
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": JOB, "namespace": NAMESPACE},
        "spec": {"pytorchReplicaSpecs": {"Master": replica, "Worker": replica}},
    }


def training_pod(replica_type: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{JOB}-{replica_type}-0",
            "namespace": NAMESPACE,
            "labels": {
                PYTORCH_JOB_NAME: JOB,
                PYTORCH_REPLICA_TYPE: replica_type,
                PYTORCH_REPLICA_INDEX: "0",
            },
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": PYTORCH_CONTAINER,
                    "image": "trainer",
                    "resources": {"limits": {GPU_RESOURCE: str(STAGES)}},
                }
            ],
        },
    }


def perseus_job() -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {"name": JOB, "namespace": NAMESPACE},
        "spec": {
            "workload": {"kind": "PyTorchJob", "name": JOB},
            "parallelism": {
                "pipelineStages": STAGES,
                "dataParallel": REPLICAS,
                "microbatches": MICROBATCHES,
            },
            # rank = dp * STAGES + pp, the example's layout: node k runs replica k.
            "rankMapping": {"order": "tp-pp-dp"},
            "policy": {
                "mode": "StragglerAware",
                "granularity": "Instruction",
                "blockingPowerWatts": BLOCKING_W,
            },
            "profiling": {
                "iterationsPerFrequency": 2,
                "warmupIterations": 1,
                "frequencyStepMHz": 60,
            },
            "stragglers": {"persistenceReports": 2, "warmupIterations": 2, "windowIterations": 3},
        },
    }


class TorchTraining:
    """The example's 2 x 2 job, one replica per node, until :meth:`stop`."""

    def __init__(self, workdir: Path, agents: list[Agent]) -> None:
        profile = workdir / "profile.csv"
        profile.write_text(cut_profile(STAGES) + "\n")
        self.out = workdir / "torch-training.out"
        nodes = []
        for agent in agents:
            nodes += ["--node", f"{agent.node},{agent.socket_dir / 'agent.sock'},{agent.gpu_state}"]
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable, str(EXAMPLE), "--dp", str(REPLICAS), "--pp", str(STAGES),
                    "--microbatches", str(MICROBATCHES), "--steps", "100000",
                    "--emulated-profile", str(profile), "--blocking-power", str(BLOCKING_W),
                    "--time-scale", str(TIME_SCALE), *nodes,
                    # A loaded 2-core machine can hold a reply past the default 0.2 s.
                    "--client-timeout-s", "2", "--client-retry-s", "1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=source_env(),
                start_new_session=True,  # its own process group: stop() ends every rank
            )  # fmt: skip

    def output(self) -> str:
        return self.out.read_text(errors="replace")[-8000:] if self.out.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        # The ranks are the parent's children, in its group: none may outlive the test.
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def emulated_gpus(agent: Agent) -> EmulatedBackend:
    return EmulatedBackend(
        agent.num_gpus,
        parse_profile(cut_profile(STAGES), "bundled, 2 stages"),
        blocking_power_w=BLOCKING_W,
        node_name=agent.node,
        state_file=agent.gpu_state,
    )


@pytest.fixture
def setup(
    cluster: Cluster, tmp_path: Path
) -> Iterator[tuple[Cluster, list[Agent], OperatorProcess, TorchTraining]]:
    require_torch()
    stack = ExitStack()
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    )
    agents = cluster.node_agents(stack, tmp_path, NODES, STAGES, socket_prefix="ptorch-")
    operator = OperatorProcess(cluster.operator_kubeconfig)
    training: TorchTraining | None = None
    try:
        for agent in agents:
            agent.start()
        training = TorchTraining(tmp_path, agents)
        yield cluster, agents, operator, training
    finally:
        if training is not None:
            training.stop()
        for agent in agents:
            agent.kill_if_running()
        operator.stop()
        stack.close()


def test_real_torch_training_is_profiled_planned_and_retargeted_behind_a_straggler(
    setup: tuple[Cluster, list[Agent], OperatorProcess, TorchTraining],
) -> None:
    cluster, agents, operator, training = setup
    core, custom = cluster.core, cluster.custom
    custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", pytorch_job()
    )
    for replica_type, node in zip(("master", "worker"), NODES, strict=True):
        pod = core.create_namespaced_pod(NAMESPACE, training_pod(replica_type, node))
        core.patch_namespaced_pod_status(
            pod.metadata.name, NAMESPACE, {"status": {"phase": "Running"}}
        )
    custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", perseus_job()
    )

    def status() -> dict[str, Any]:
        job = custom.get_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", JOB
        )
        return dict(job.get("status") or {})

    def applied() -> int | None:
        s = status()
        if s.get("phase") != "Running" or s.get("plan") is None:
            return None
        plans = custom.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, resources.NODE_PLAN_PLURAL,
            label_selector=f"{resources.JOB_LABEL}={JOB}",
        )["items"]  # fmt: skip
        done = len(plans) == len(NODES) and all(
            p.get("status", {}).get("observedRevision") == s["revision"] for p in plans
        )
        return int(s["revision"]) if done else None

    def wait(what: str, check: Any) -> Any:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            if training.proc.poll() is not None:
                pytest.fail(f"the training exited waiting for {what}:\n{training.output()}")
            time.sleep(0.5)
        pytest.fail(
            f"timed out waiting for {what}; status {json.dumps(status(), indent=1)}\n"
            f"training:\n{training.output()}\noperator:\n{operator.stop()[-8000:]}"
        )

    revision = wait("profiling from the real processes, then the plan applied", applied)
    profile_map = core.read_namespaced_config_map(profile_config_map_name(JOB), NAMESPACE)
    profile = parse_profile(profile_map.data[PROFILE_KEY], "stored")
    assert profile.num_stages == STAGES
    truth = parse_profile(cut_profile(STAGES), "bundled")
    for stage in range(STAGES):
        for name in ("forward", "backward"):
            m, t = profile.get(stage, name), truth.get(stage, name)
            top = int(max(m.frequencies_mhz))
            k = list(t.frequencies_mhz).index(top)
            measured_s = float(m.times_s[list(m.frequencies_mhz).index(top)])
            # The real processes took the padded time (plus the hooks' round trips).
            want_s = float(t.times_s[k]) * TIME_SCALE
            assert want_s <= measured_s <= 1.5 * want_s, (stage, name, measured_s, want_s)
    plan = status()["plan"]
    assert plan["expectedSavingsRatio"] > 0, plan

    def mismatches() -> list[float]:
        return [
            sum(a.metric("perseus_agent_apply_errors_total", reason="schedule_mismatch"))
            for a in agents
        ]

    # From profiling on, the plan landing mid-iteration included: every computation where the
    # plan expects it.
    time.sleep(5)  # iterations under the plan, computation by computation
    assert mismatches() == [0.0] * len(agents), mismatches()
    for agent in agents:
        for gpu in range(STAGES):
            changes = agent.metric("perseus_gpu_clock_changes_total", gpu=str(gpu))
            assert changes and changes[0] > 0, (agent.node, gpu, changes)

    for index in range(STAGES):  # node 1's GPUs slow down (e.g. thermal throttling)
        emulated_gpus(agents[1]).set_slowdown(index, SLOWDOWN)

    def retargeted() -> dict[str, Any] | None:
        s = status()
        return s if s.get("stragglers") and (applied() or 0) > revision else None

    s = wait("the straggler detected and the healthy replica re-targeted", retargeted)
    [straggler] = s["stragglers"]
    assert straggler["dataParallelRank"] == 1 and straggler["node"] == NODES[1], straggler
    assert s["plan"]["targetIterationSeconds"] > s["frontier"]["tMinSeconds"], s["plan"]
    print(
        f"T_min {s['frontier']['tMinSeconds']:.4f} s, expected savings at T_min "
        f"{plan['expectedSavingsRatio']:.2%}; straggler slowdown {straggler['slowdown']:.3f}, "
        f"re-targeted to {s['plan']['targetIterationSeconds']:.4f} s"
    )
