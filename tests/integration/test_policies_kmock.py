"""Cluster-wide PerseusPolicies with the operator process against kmock's Kubernetes API: the
opt-in scenario (:mod:`policy_scenario`), and a policy the API server lets through (kmock
applies no CRD schema) but the operator finds invalid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from perseus_api.policy import POLICY_PLURAL
from perseus_operator.cluster.kube.client import WORKLOAD_RESOURCES
from support.kmock_server import KmockServer
from support.operator_harness import RESOURCES, VERBS, OperatorProcess, operator_problems
from support.policy_scenario import policy_body, policy_status, run_opt_in_scenario

POLICY_RESOURCES: dict[str, dict[str, Any]] = {
    **RESOURCES,
    "v1/pods": {"kind": "Pod", "singular": "pod", "namespaced": True, "verbs": VERBS},
    f"{resources.GROUP}/{resources.VERSION}/{POLICY_PLURAL}": {
        "kind": "PerseusPolicy",
        "singular": "perseuspolicy",
        "namespaced": False,
        "subresources": {"status"},
        "verbs": VERBS,
    },
    **{
        f"{group}/{version}/{plural}": {
            "kind": kind.value,
            "singular": kind.value.lower(),
            "namespaced": True,
            "subresources": {"status"},
            "verbs": VERBS,
        }
        for kind, (group, version, plural) in WORKLOAD_RESOURCES.items()
    },
}


@pytest.fixture
def apis(tmp_path: Path) -> Iterator[tuple[Any, Any, OperatorProcess]]:
    with KmockServer(POLICY_RESOURCES) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        operator = OperatorProcess(kubeconfig, policy_interval_s=0.5)
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        try:
            yield (
                kubernetes.client.CoreV1Api(client),
                kubernetes.client.CustomObjectsApi(client),
                operator,
            )
        finally:
            log = operator.stop()
            client.close()
        problems = operator_problems(log)
        assert not problems, log


def test_a_policy_manages_the_workloads_of_an_opted_in_namespace(
    apis: tuple[Any, Any, OperatorProcess],
) -> None:
    core, custom, operator = apis
    run_opt_in_scenario(core, custom, operator.wait_for)


def test_a_policy_the_operator_finds_invalid_says_why_in_its_status(
    apis: tuple[Any, Any, OperatorProcess],
) -> None:
    _, custom, operator = apis
    broken = policy_body("broken", workloads=[{"kind": "Pods"}])
    custom.create_cluster_custom_object(resources.GROUP, resources.VERSION, POLICY_PLURAL, broken)
    status = operator.wait_for(
        "the verdict", lambda: (s := policy_status(custom, "broken")).get("conditions") and s
    )
    accepted = {c["type"]: c for c in status["conditions"]}["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidSpec")
    assert "workloads.0: Value error, kind Pods needs labelSelector" in accepted["message"]
    assert status["managedJobs"] == 0
