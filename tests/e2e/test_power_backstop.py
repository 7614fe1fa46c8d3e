"""A power budget's hard backstop on a real kube-apiserver: per-GPU power limits on the agents'
emulated GPUs, set and given back.

Two Nodes of one power domain (a rack label), four emulated GPUs each, a ``perseus-node-agent``
on each (Kubernetes mode, the chart's agent identity) and ``perseus-operator`` as the chart's
operator service account, its budget rounds every second. A Stage-granularity job of 2 x 4 GPUs
plans from a stored profile (no training process is needed for Stage clocks). Then:

1. a ``PerseusPowerBudget`` of the rack, at 90 % of the job's ``T_min`` draw and with
   ``enforcement: PlansAndPowerLimits``: every GPU of the job gets the power limit of its share
   (the job's allocated watts over its 8 GPUs, plus the safety margin), through its node plans,
   on the emulated GPUs themselves, with the limits it replaced recorded in the agents' reset
   records;
2. switched to ``Plans``: the limits leave the plans and every GPU has its original limit back;
3. an infeasible budget (100 W) with the backstop: ``Infeasible``, every GPU at the share of the
   job's least-power point; then the budget deleted: the same as 2, and the job keeps running
   its clock plans.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from perseus_agent.gpu.base import PowerLimitRange
from perseus_agent.gpu.emulated import EmulatedBackend
from perseus_api import resources
from perseus_api.job import PerseusJobSpec
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_api.profile import load_profile
from perseus_operator.jobs.profile_source import (
    BLOCKING_POWER_KEY,
    GPU_PRODUCT_LABEL,
    MODEL_LABEL,
    NODE_GPU_PRODUCT_LABEL,
    PIPELINE_KEY,
    PROFILE_KEY,
    pipeline_key,
)
from support.agent_process import PROFILE, Agent
from support.cluster_harness import Cluster
from support.emulated_training import BLOCKING_W, GPUS, REPLICAS, STAGES
from support.emulated_training_objects import perseus_job, pytorch_job, training_pod
from support.operator_harness import OperatorProcess, cut_profile

NAMESPACE = "ml"  # the chart's RBAC is set up for it
JOB = "backstopped"
BUDGET = "rack-backstop"
MODEL = "gpt3-175b-backstop"  # its own: the profile it stores stays in the shared namespace
PRODUCT = "NVIDIA-A100-SXM4-80GB"
RACK_LABEL = "topology.example.com/rack"
NODES = [f"backstop-node-{i}" for i in range(REPLICAS)]
MARGIN = 0.05
TIMEOUT_S = 120.0
GROUP, VERSION = resources.GROUP, resources.VERSION


_PROFILE = load_profile(PROFILE)


def gpu_power_limits(agent: Agent) -> list[float]:
    """The power limit in force on each of the agent's emulated GPUs, from the shared hardware
    state (what the agent set through its backend, not what it reports)."""
    gpus = EmulatedBackend(
        agent.num_gpus, _PROFILE, blocking_power_w=BLOCKING_W, node_name=agent.node,
        state_file=agent.gpu_state,
    )  # fmt: skip
    try:
        return [gpus.power_limit_w(i) for i in range(agent.num_gpus)]
    finally:
        gpus.close()


def power_limit_range() -> PowerLimitRange:
    gpus = EmulatedBackend(1, _PROFILE, blocking_power_w=BLOCKING_W)
    return gpus.power_limit_range_w(0)


def recorded_power_limits(agent: Agent) -> list[dict[str, Any]]:
    """The GPUs whose power limit the agent's reset record says it changed."""
    path = agent.state_dir / "reset-state.json"
    if not path.exists():
        return []
    record = json.loads(path.read_text())
    return [g for g in record["gpus"] if "power_limit" in g["locked"]]


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("backstop")
    stack = ExitStack()
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    )
    agents = cluster.node_agents(stack, workdir, NODES, GPUS, socket_prefix="perseus-")
    for node in NODES:
        labels = {NODE_GPU_PRODUCT_LABEL: PRODUCT, RACK_LABEL: "r1"}
        cluster.core.patch_node(node, {"metadata": {"labels": labels}})
    operator = OperatorProcess(
        cluster.operator_kubeconfig, extra_env={"PERSEUS_OPERATOR_BUDGET_INTERVAL_S": "1"}
    )
    try:
        for agent in agents:
            agent.start()
        yield cluster, agents, operator
    finally:
        for agent in agents:
            agent.kill_if_running()
        operator.stop()
        stack.close()


def test_a_budget_backstop_limits_the_jobs_gpus_and_gives_them_back(setup: Any) -> None:
    cluster, agents, operator = setup
    core, custom = cluster.core, cluster.custom
    allowed = power_limit_range()
    default_w = allowed.default_w
    assert [gpu_power_limits(a) for a in agents] == [[default_w] * GPUS] * REPLICAS

    # The job, planned from a stored profile of its model (no profiling, no training needed).
    custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", pytorch_job(JOB)
    )
    for replica_type, node in zip(("master", "worker"), NODES, strict=True):
        pod = core.create_namespaced_pod(NAMESPACE, training_pod(JOB, replica_type, node))
        core.patch_namespaced_pod_status(
            pod.metadata.name, NAMESPACE, {"status": {"phase": "Running"}}
        )
    body = perseus_job(JOB, JOB, mode="Intrinsic", granularity="Stage")
    body["spec"]["profiling"]["model"] = MODEL
    spec = PerseusJobSpec.model_validate(body["spec"])
    core.create_namespaced_config_map(
        NAMESPACE,
        {
            "metadata": {
                "name": "backstop-profile",
                "labels": {MODEL_LABEL: MODEL, GPU_PRODUCT_LABEL: PRODUCT},
            },
            "data": {
                PROFILE_KEY: cut_profile(STAGES),
                PIPELINE_KEY: pipeline_key(spec),
                BLOCKING_POWER_KEY: str(BLOCKING_W),
            },
        },
    )
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "perseusjobs", body)

    def job() -> dict[str, Any]:
        found: dict[str, Any] = custom.get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "perseusjobs", JOB
        )
        return found

    def node_plans() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = custom.list_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, resources.NODE_PLAN_PLURAL,
            label_selector=f"{resources.JOB_LABEL}={JOB}",
        )["items"]  # fmt: skip
        return items

    def planned_limits() -> list[float | None]:
        return [a.get("powerLimitWatts") for p in node_plans() for a in p["spec"]["assignments"]]

    def budget() -> dict[str, Any]:
        found: dict[str, Any] = custom.get_cluster_custom_object(
            GROUP, VERSION, BUDGET_PLURAL, BUDGET
        )
        return found

    def applied() -> bool:
        statuses = [g.get("status") for p in node_plans() for g in p.get("status", {}).get(
            "gpus", [])]  # fmt: skip
        return len(statuses) == STAGES * REPLICAS and set(statuses) <= {"Applied", "Clamped"}

    operator.wait_for(
        "the job Running with its clock plans applied",
        lambda: job().get("status", {}).get("phase") == "Running" and applied(),
        TIMEOUT_S,
    )
    assert planned_limits() == [None] * STAGES * REPLICAS

    def all_limits() -> list[float]:
        return [w for a in agents for w in gpu_power_limits(a)]

    def limited_to_shares() -> float | None:
        """The share every GPU carries, once the status, the plans and the GPUs agree on it."""
        jobs = budget().get("status", {}).get("jobs") or []
        if len(jobs) != 1 or jobs[0]["gpus"] != STAGES * REPLICAS:
            return None
        share_w = jobs[0]["allocatedWatts"] / jobs[0]["gpus"] * (1 + MARGIN)
        limits = [w for w in planned_limits() if w is not None]
        if len(limits) != STAGES * REPLICAS or any(abs(w - share_w) > 0.2 for w in limits):
            return None
        clamped = [allowed.clamp_w(w) for w in limits]  # what the agents set
        return share_w if all_limits() == clamped else None

    def restored() -> bool:
        return (
            planned_limits() == [None] * STAGES * REPLICAS
            and all_limits() == [default_w] * STAGES * REPLICAS
            and not any(recorded_power_limits(a) for a in agents)
        )

    # 1. A budget of the rack: first far above the job's draw, to read its T_min draw (what the
    # allocation gives it); then at 90 % of that, with the backstop.
    custom.create_cluster_custom_object(
        GROUP, VERSION, BUDGET_PLURAL, budget_object(100_000.0, enforcement="Plans")
    )

    def t_min_w() -> float | None:
        jobs = budget().get("status", {}).get("jobs") or []
        ok = len(jobs) == 1 and jobs[0]["gpus"] == STAGES * REPLICAS
        return float(jobs[0]["allocatedWatts"]) if ok and jobs[0]["slowdownRatio"] == 0 else None

    full_w = operator.wait_for("the job in the budget's allocation", t_min_w, TIMEOUT_S)
    assert planned_limits() == [None] * STAGES * REPLICAS  # Plans: no limits
    revision = job()["status"]["plan"]["revision"]
    patch_budget(
        custom,
        {"spec": {"budgetWatts": round(0.9 * full_w), "enforcement": "PlansAndPowerLimits"}},
    )
    share_w = operator.wait_for("the GPUs limited to their shares", limited_to_shares, TIMEOUT_S)
    # Below the GPUs' default (so it limits something), within what they accept.
    assert BLOCKING_W < share_w < default_w
    # The node plans (what the agents apply) and the job's status are separate writes: the
    # status may follow the limits by a tick on a busy machine.
    operator.wait_for(
        "the job's status at the rewritten plans' revision",
        lambda: job()["status"]["plan"]["revision"] > revision or None,
        TIMEOUT_S,
    )
    for agent in agents:
        recorded = recorded_power_limits(agent)
        assert sorted(g["index"] for g in recorded) == list(range(GPUS)), agent.log
        assert {g["power_limit_w"] for g in recorded} == {default_w}  # the limit it replaced
        exported = agent.metric("perseus_gpu_power_limit_watts")
        assert len(exported) == GPUS and all(abs(w - share_w) <= 0.2 for w in exported)

    def reported() -> bool:  # the agents' reports in the node plans' status say the same
        gpus = [g for p in node_plans() for g in p.get("status", {}).get("gpus", [])]
        limits = [g.get("powerLimitWatts") for g in gpus]
        return len(limits) == STAGES * REPLICAS and limits == all_limits()

    operator.wait_for("the limits in the node plans' status", reported, TIMEOUT_S)

    # 2. The same budget without the backstop: the GPUs get their own limits back.
    patch_budget(custom, {"spec": {"enforcement": "Plans"}})
    operator.wait_for("the original power limits back", restored, TIMEOUT_S)
    assert job()["status"]["phase"] == "Running"

    # 3. An infeasible budget with the backstop: every GPU at the share of the job's least-power
    # point; then the budget deleted.
    patch_budget(custom, {"spec": {"budgetWatts": 100, "enforcement": "PlansAndPowerLimits"}})

    def infeasible() -> float | None:
        conditions = budget().get("status", {}).get("conditions") or []
        said = any(c["type"] == "Infeasible" and c["status"] == "True" for c in conditions)
        return limited_to_shares() if said else None

    least_share_w = operator.wait_for("Infeasible, the GPUs limited", infeasible, TIMEOUT_S)
    assert least_share_w < share_w
    assert budget()["status"]["missingWatts"] > 0
    custom.delete_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, BUDGET)
    operator.wait_for("the original power limits back after the delete", restored, TIMEOUT_S)
    assert job()["status"]["phase"] == "Running"
    assert applied(), "the clock plans stay applied"
    for agent in agents:
        assert agent.proc is not None and agent.proc.poll() is None, agent.log
        assert "foreign" not in agent.log

    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "perseusjobs", JOB)
    operator.wait_for("the job's node plans to go", lambda: not node_plans(), TIMEOUT_S)


def budget_object(budget_w: float, *, enforcement: str) -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusPowerBudget",
        "metadata": {"name": BUDGET},
        "spec": {
            "budgetWatts": budget_w,
            "nodeSelector": {"matchLabels": {RACK_LABEL: "r1"}},
            "safetyMarginRatio": MARGIN,
            "enforcement": enforcement,
        },
    }


def patch_budget(custom: Any, patch: dict[str, Any]) -> None:
    custom.patch_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, BUDGET, patch)
