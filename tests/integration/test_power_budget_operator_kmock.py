"""The operator process with a PerseusPowerBudget, against kmock's Kubernetes API: the wiring
of the budget controller (handlers' rounds, the frontiers the jobs' reconciles hold, the
re-target annotation taken by the job's reconcile) from budget to node plans and back.

A job runs (agents simulated) on two nodes of rack a; a budget of 1 W for the rack is
infeasible: the status says Infeasible with the watts missing, the job is re-targeted to its
least-power point and its node plans are rewritten for every replica. Deleting the budget
brings the job back to its T_min plans.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.jobs.job_decisions import POWER_TARGET_ANNOTATION
from support.kmock_server import KmockServer
from support.operator_harness import (
    JOBS,
    PLANS,
    RESOURCES,
    VERBS,
    OperatorProcess,
    SimulatedAgents,
    operator_problems,
    perseus_job,
    pod,
    profile_of,
)

NS = "ml"
STAGES, DP, MICROBATCHES, GPUS_PER_POD = 4, 2, 8, 4
GROUP, VERSION = resources.GROUP, resources.VERSION
BUDGETS = f"{GROUP}/{VERSION}/{BUDGET_PLURAL}"
BUDGET_RESOURCES: dict[str, dict[str, Any]] = {
    **RESOURCES,
    "v1/nodes": {"kind": "Node", "singular": "node", "namespaced": False, "verbs": VERBS},
    BUDGETS: {
        "kind": "PerseusPowerBudget",
        "singular": "perseuspowerbudget",
        "namespaced": False,
        "subresources": {"status"},
        "verbs": VERBS,
    },
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KmockServer, Path]]:
    with KmockServer(BUDGET_RESOURCES) as server:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


def test_an_infeasible_budget_retargets_the_job_and_deleting_it_gives_t_min_back(
    cluster: tuple[KmockServer, Path],
) -> None:
    server, kubeconfig = cluster
    operator = OperatorProcess(kubeconfig, extra_env={"PERSEUS_OPERATOR_BUDGET_INTERVAL_S": "1"})
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    wait_for = operator.wait_for
    try:
        for index in range(2):
            labels = {"topology.example.com/rack": "a"}
            core.create_node({"metadata": {"name": f"gpt3-node-{index}", "labels": labels}})
            core.create_namespaced_pod(NS, pod("gpt3", index, NS, GPUS_PER_POD))

        def job() -> dict[str, Any]:
            return server.objects(JOBS).get((NS, "gpt3")) or {}

        def annotation() -> str | None:
            annotations = job().get("metadata", {}).get("annotations") or {}
            value: str | None = annotations.get(POWER_TARGET_ANNOTATION)
            return value

        def plans_used() -> set[str]:
            return {
                a["plan"] for obj in server.objects(PLANS).values()
                for a in obj["spec"]["assignments"]
            }  # fmt: skip

        def budget_status() -> dict[str, Any]:
            obj = server.objects(BUDGETS).get((None, "rack-a")) or server.objects(BUDGETS).get(
                ("", "rack-a")
            )
            status: dict[str, Any] = (obj or {}).get("status") or {}
            return status

        body = perseus_job("gpt3", NS, "gpt3", stages=STAGES, dp=DP, microbatches=MICROBATCHES)
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, "perseusjobs", body)
        with SimulatedAgents(custom, NS, profile_of(STAGES), jobs={"gpt3"}) as agents:
            status = wait_for("Running", lambda: job().get("status", {}).get("phase") == "Running"
                              and job()["status"])  # fmt: skip
            t_min = status["frontier"]["tMinSeconds"]
            agents.t_min_s["gpt3"] = t_min
            assert plans_used() == {"tmin"}
            assert annotation() is None

            budget = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "PerseusPowerBudget",
                "metadata": {"name": "rack-a"},
                "spec": {
                    "budgetWatts": 1.0,
                    "safetyMarginRatio": 0.0,
                    "nodeSelector": {"matchLabels": {"topology.example.com/rack": "a"}},
                },
            }
            custom.create_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, budget)
            infeasible = wait_for(
                "Infeasible",
                lambda: (
                    any(
                        c["type"] == "Infeasible" and c["status"] == "True"
                        for c in budget_status().get("conditions", [])
                    )
                    and budget_status()
                ),
            )
            assert infeasible["nodes"] == 2 and infeasible["managedJobs"] == 1
            (allocation,) = infeasible["jobs"]
            assert allocation["gpus"] == STAGES * DP
            assert infeasible["missingWatts"] == pytest.approx(
                allocation["allocatedWatts"] - 1.0, abs=0.2
            )
            assert allocation["slowdownRatio"] > 0
            target = wait_for("the power target annotation", annotation)
            assert float(target) > t_min
            wait_for("every replica re-targeted", lambda: plans_used() == {"retargeted"})
            # The status follows the plans once kopf has applied the reconcile's patch.
            wait_for(
                "the status' target",
                lambda: (
                    job()["status"]["plan"]["targetIterationSeconds"]
                    == pytest.approx(float(target), rel=1e-3)
                ),
            )

            custom.delete_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, "rack-a")
            wait_for("the annotation removed", lambda: annotation() is None)
            wait_for("T_min again", lambda: plans_used() == {"tmin"})
            wait_for(
                "the status' T_min target",
                lambda: (
                    job()["status"]["plan"]["targetIterationSeconds"]
                    == pytest.approx(t_min, rel=1e-3)
                ),
            )
            # Deleted before the operator stops, so no reconcile is in flight when it does.
            custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "perseusjobs", "gpt3")
            wait_for("the job to go", lambda: not job())
            assert not agents.errors
    finally:
        log = operator.stop()
        client.close()
    assert not operator_problems(log), log
