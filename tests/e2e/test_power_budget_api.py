"""The power budget controller on the real kube-apiserver, as the operator's service account
(the chart's RBAC): its reads, the budget's status it writes (the CRD's schema judges it) and
the re-target annotation on the job. The job's frontier is the real one of the bundled GPT-3
A100 profile; its node plan and the agent's report with the GPUs' energy counters are written
as the operator and the agents write them. (The whole loop with the operator process is
``tests/integration/test_power_budget_operator_kmock.py``, against kmock.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from perseus_api import resources
from perseus_api.conventions import rfc3339
from perseus_api.node_plan import NodePlan
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.cluster.kube.client import KubeClient, load_api_client
from perseus_operator.jobs.job_decisions import POWER_TARGET_ANNOTATION
from perseus_operator.power.budget_controller import BudgetController, JobFrontier
from perseus_planner.frontier import Frontier
from perseus_planner.power.frontier_points import frontier_points
from support.cluster_harness import Cluster
from support.factories import pipeline_plan_fields
from support.operator_harness import perseus_job

# Its own namespace, node, rack and budget: the e2e cluster is shared, and the budget e2e
# (test_power_budget_cluster.py) has a domain of budget-node-* nodes of rack e2e.
NAMESPACE = "budget-api"
NODE = "budget-api-node"
RACK = {"topology.example.com/rack": "budget-api"}
BUDGET = "rack-budget-api"
STAGES = 8
GROUP, VERSION = resources.GROUP, resources.VERSION
START_S = 1_800_000_000.0

SolveFrontier = Callable[[str, str, int], Frontier]


def _status_of_plan(now_s: float, energy_j: float) -> dict[str, Any]:
    gpus = [
        {"uuid": f"GPU-{i}", "index": i, "plan": "p", "stage": i, "status": "Applied",
         "energyJoules": energy_j / STAGES}
        for i in range(STAGES)
    ]  # fmt: skip
    return {"observedRevision": 1, "reportedAt": rfc3339(now_s), "gpus": gpus}


def test_the_controller_writes_an_infeasible_status_and_retargets_as_the_operator(
    cluster: Cluster, solved_frontier: SolveFrontier
) -> None:
    frontier = solved_frontier("gpt3-175b", "a100_sxm", 12)
    points, _ = frontier_points("gpt3", frontier, 1)
    least_w = float(points.powers_w.min())
    cluster.plane.apply([{"apiVersion": "v1", "kind": "Namespace",
                          "metadata": {"name": NAMESPACE}}])  # fmt: skip
    cluster.node(NODE, STAGES)
    cluster.core.patch_node(NODE, {"metadata": {"labels": RACK}})
    custom = cluster.custom
    custom.create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, "perseusjobs",
        perseus_job("gpt3", NAMESPACE, "gpt3", stages=STAGES, dp=1, microbatches=12),
    )  # fmt: skip
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NAMESPACE, "perseusjobs", "gpt3", {"status": {"phase": "Running"}}
    )
    plan = NodePlan(
        node=NODE,
        namespace=NAMESPACE,
        job="gpt3",
        revision=1,
        granularity="Instruction",
        plans={"p": pipeline_plan_fields(num_stages=STAGES, num_microbatches=STAGES)},
        assignments=[{"gpu_index": i, "plan": "p", "stage": i, "rank": i} for i in range(STAGES)],
    )
    cluster.plane.apply([resources.node_plan_object(plan)])
    plan_name = resources.node_plan_name("gpt3", NODE)

    clock = [START_S]
    kube = KubeClient(load_api_client(str(cluster.operator_kubeconfig)))
    controller = BudgetController(
        kube,
        lambda: {(NAMESPACE, "gpt3"): JobFrontier(frontier)},
        interval_s=3600,
        now_s=lambda: clock[0],
    )

    def report(energy_j: float) -> None:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, NAMESPACE, resources.NODE_PLAN_PLURAL, plan_name,
            {"status": _status_of_plan(clock[0], energy_j)},
        )  # fmt: skip

    def annotation() -> str | None:
        job = custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "perseusjobs", "gpt3")
        value: str | None = (job["metadata"].get("annotations") or {}).get(POWER_TARGET_ANNOTATION)
        return value

    budget_w = 0.5 * least_w
    try:
        report(0.0)
        custom.create_cluster_custom_object(
            GROUP, VERSION, BUDGET_PLURAL,
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "PerseusPowerBudget",
                "metadata": {"name": BUDGET},
                "spec": {
                    "budgetWatts": budget_w,
                    "nodeSelector": {"matchLabels": RACK},
                },
            },
        )  # fmt: skip
        asyncio.run(controller.sync())
        clock[0] += 30.0
        report(least_w * 30.0)
        asyncio.run(controller.sync())

        stored = custom.get_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, BUDGET)
        status = stored["status"]
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["Infeasible"]["status"] == "True"
        assert conditions["Met"]["status"] == "False"  # drawing its least, over the budget
        assert status["measuredWatts"] == pytest.approx(least_w, rel=1e-3)
        assert status["missingWatts"] == pytest.approx(least_w - 0.95 * budget_w, abs=0.2)
        assert status["nodes"] == 1 and status["managedJobs"] == 1
        (job,) = status["jobs"]
        assert (job["namespace"], job["name"], job["gpus"]) == (NAMESPACE, "gpt3", STAGES)
        assert float(annotation() or 0) > frontier.times_s.min()

        custom.delete_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, BUDGET)
        asyncio.run(controller.sync())
        assert annotation() is None
    finally:
        kube.close()
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "perseusjobs", "gpt3")
