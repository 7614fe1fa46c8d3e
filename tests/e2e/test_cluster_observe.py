"""Observe changes no clock, on a real kube-apiserver with real node agents and training.

Two Nodes labelled with their GPU product, four emulated GPUs each, a ``perseus-node-agent``
on each (Kubernetes mode, the chart's agent identity) and the emulated 2 x 4 1F1B training
calling them through ``perseus_client``, so that any profiling plan or plan written would be
followed at once. The operator runs as the chart's service account. An ``Observe`` job of a
named model:

1. with no profile stored: waits with ``Profiled=False/ProfileRequired`` saying how to get
   one; no node plan exists, and the agents count no clock change;
2. once a profile of that model, pipeline and GPU product is stored (labelled as a job of the
   model stores it): plans from it, ``Running`` with its expected savings, still no node plan
   and no clock change. This is the operator's label-selected ConfigMap list and its Node
   reads, under its RBAC;
3. switched to ``Intrinsic``: the agents count clock changes (the check above can see them).
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from perseus_api import resources
from perseus_api.job import PerseusJobSpec
from perseus_operator.jobs.profile_source import (
    BLOCKING_POWER_KEY,
    GPU_PRODUCT_LABEL,
    MODEL_LABEL,
    NODE_GPU_PRODUCT_LABEL,
    PIPELINE_KEY,
    PROFILE_KEY,
    pipeline_key,
)
from support.agent_process import Agent
from support.cluster_harness import Cluster
from support.emulated_training import BLOCKING_W, GPUS, REPLICAS, STAGES, Training
from support.emulated_training_objects import perseus_job, pytorch_job, training_pod
from support.operator_harness import OperatorProcess, cut_profile

NAMESPACE = "ml"  # the chart's RBAC and the training's pods are set up for it
JOB = "observed"
MODEL = "gpt3-175b-observe"  # its own: the cluster is shared, and a stored profile of
# another test's model in this namespace would end step 1 (ProfileRequired) before it starts
PRODUCT = "NVIDIA-A100-SXM4-80GB"
NODES = [f"observe-node-{i}" for i in range(REPLICAS)]
TIMEOUT_S = 120.0
QUIET_S = 3.0
"""How long nothing may happen after each verdict: six reconcile ticks of the operator."""


def clock_changes(agent: Agent) -> float:
    """``perseus_gpu_clock_changes_total`` over the agent's GPUs, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pattern = r"^perseus_gpu_clock_changes_total\{[^}]*\} ([0-9.e+]+)$"
    return sum(float(m) for m in re.findall(pattern, text, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("observe")
    stack = ExitStack()
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    )
    agents = cluster.node_agents(stack, workdir, NODES, GPUS, socket_prefix="perseus-")
    for node in NODES:
        cluster.core.patch_node(node, {"metadata": {"labels": {NODE_GPU_PRODUCT_LABEL: PRODUCT}}})
    operator = OperatorProcess(cluster.operator_kubeconfig)
    training = None
    try:
        for agent in agents:
            agent.start()
        training = Training(workdir, agents, hooks=True)
        yield cluster, agents, operator, training
    finally:
        if training is not None:
            training.stop()
        for agent in agents:
            agent.kill_if_running()
        operator.stop()
        stack.close()


def test_observe_changes_no_clock_with_or_without_a_profile(setup: Any) -> None:
    cluster, agents, operator, training = setup
    core, custom = cluster.core, cluster.custom
    training.wait_iterations(2)  # every rank called its agent in
    changes_before = [clock_changes(a) for a in agents]

    custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", pytorch_job(JOB)
    )
    for replica_type, node in zip(("master", "worker"), NODES, strict=True):
        pod = core.create_namespaced_pod(NAMESPACE, training_pod(JOB, replica_type, node))
        core.patch_namespaced_pod_status(
            pod.metadata.name, NAMESPACE, {"status": {"phase": "Running"}}
        )
    body = perseus_job(JOB, JOB, mode="Observe", granularity="Instruction")
    body["spec"]["profiling"]["model"] = MODEL
    custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", body
    )

    def job() -> dict[str, Any]:
        found: dict[str, Any] = custom.get_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", JOB
        )
        return found

    def condition(kind: str) -> dict[str, Any]:
        conditions = job().get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == kind), {})

    def node_plans() -> list[Any]:
        items: list[Any] = custom.list_namespaced_custom_object(
            resources.GROUP,
            resources.VERSION,
            NAMESPACE,
            resources.NODE_PLAN_PLURAL,
            label_selector=f"{resources.JOB_LABEL}={JOB}",
        )["items"]
        return items

    def quiet() -> None:
        """Nothing written, nothing locked, no clock changed, for :data:`QUIET_S`."""
        deadline = time.monotonic() + QUIET_S
        while time.monotonic() < deadline:
            assert node_plans() == []
            assert [a.clocks() for a in agents] == [[None] * GPUS] * len(agents)
            time.sleep(0.2)
        assert [clock_changes(a) for a in agents] == changes_before

    required = operator.wait_for(
        "ProfileRequired",
        lambda: condition("Profiled").get("reason") == "ProfileRequired" and condition("Profiled"),
        TIMEOUT_S,
    )
    # The nodes' GPU product is known (their label), so the message names what to run.
    assert (
        f"run a job of model {MODEL} on {PRODUCT} GPUs with {STAGES} pipeline"
        in (required["message"])
    )
    quiet()

    # A profile as a job of the model stores it (labels and pipeline key), the true one.
    spec = PerseusJobSpec.model_validate(body["spec"])
    core.create_namespaced_config_map(
        NAMESPACE,
        {
            "metadata": {
                "name": "earlier-job-profile",
                "labels": {MODEL_LABEL: MODEL, GPU_PRODUCT_LABEL: PRODUCT},
            },
            "data": {
                PROFILE_KEY: cut_profile(STAGES),
                PIPELINE_KEY: pipeline_key(spec),
                BLOCKING_POWER_KEY: str(BLOCKING_W),
            },
        },
    )
    status = operator.wait_for(
        "Running from the stored profile",
        lambda: job().get("status", {}).get("phase") == "Running" and job()["status"],
        TIMEOUT_S,
    )
    assert status["frontier"]["profileConfigMap"] == "earlier-job-profile"
    assert status["plan"]["expectedSavingsRatio"] > 0.03
    assert condition("PlanApplied")["reason"] == "Observe"
    quiet()
    training.wait_iterations(2)  # the training went on, at default clocks
    assert [clock_changes(a) for a in agents] == changes_before

    # The instrument sees changes: the same job in a mode that changes clocks moves them.
    custom.patch_namespaced_custom_object(
        resources.GROUP,
        resources.VERSION,
        NAMESPACE,
        "perseusjobs",
        JOB,
        {"spec": {"policy": {"mode": "Intrinsic"}}},
    )
    operator.wait_for(
        "clock changes under Intrinsic",
        lambda: all(
            clock_changes(a) > before for a, before in zip(agents, changes_before, strict=True)
        ),
        TIMEOUT_S,
    )
    assert not node_plans()[0]["spec"].get("profiling")  # planned from the stored profile

    custom.delete_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", JOB
    )

    # Other modules' jobs may share the namespace: only this one must go (with its plans).
    def gone() -> bool:
        jobs = custom.list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs"
        )["items"]
        return not [j for j in jobs if j["metadata"]["name"] == JOB] and not node_plans()

    operator.wait_for("the job and its node plans to go", gone, TIMEOUT_S)
