"""Cluster-wide PerseusPolicies on a real kube-apiserver: the CRD refuses malformed policies
with the rule's words, and the operator, as its own service account (the chart's RBAC), runs
the opt-in scenario (:mod:`policy_scenario`)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from perseus_api.policy import POLICY_PLURAL
from support.cluster_harness import Cluster
from support.operator_harness import OperatorProcess
from support.policy_scenario import (
    GROUP,
    VERSION,
    create_workload,
    delete_workload,
    perseus_jobs,
    policy_body,
    run_opt_in_scenario,
)
from support.workload_objects import pytorch_job

GC_TIMEOUT_S = 60.0

# name -> (spec fields replaced, the field path and the words of the API server's message)
MALFORMED_POLICIES: dict[str, tuple[dict[str, Any], str, str]] = {
    "empty-namespace-selector": (
        {"namespaceSelector": {}},
        "spec.namespaceSelector",
        "an empty selector would select every namespace",
    ),
    "no-namespace-selector": ({"namespaceSelector": None}, "spec.namespaceSelector", "Required"),
    "pods-without-labels": (
        {"workloads": [{"kind": "Pods"}]},
        "spec.workloads[0]",
        "kind Pods needs labelSelector",
    ),
    "empty-workload-selector": (
        {"workloads": [{"kind": "PyTorchJob", "labelSelector": {}}]},
        "spec.workloads[0].labelSelector",
        "labelSelector must have matchLabels or matchExpressions",
    ),
    "unknown-kind": (
        {"workloads": [{"kind": "Deployment"}]},
        "spec.workloads[0].kind",
        "Unsupported value",
    ),
    "no-workloads": ({"workloads": []}, "spec.workloads", "should have at least 1 items"),
    "priority-too-high": ({"priority": 5000}, "spec.priority", "less than or equal to 1000"),
    "unknown-mode": ({"policy": {"mode": "Turbo"}}, "spec.policy.mode", "Unsupported value"),
    "no-hysteresis": (
        {"stragglers": {"slowdownThreshold": 1.02, "recoveryThreshold": 1.05}},
        "spec.stragglers",
        "recoveryThreshold must be below slowdownThreshold",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_POLICIES))
def test_a_malformed_policy_is_refused_by_the_api_server(cluster: Cluster, case: str) -> None:
    fields, field, words = MALFORMED_POLICIES[case]
    body = policy_body(case, **fields)
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    done = cluster.plane.kubectl("create", "-f", "-", stdin=json.dumps(body), check=False)
    assert done.returncode != 0, f"{case} was accepted: {done.stdout}"
    message = done.stderr
    assert f'PerseusPolicy "{case}" is invalid' in message, message
    assert field in message and words in message, message


def test_a_policy_manages_the_workloads_of_an_opted_in_namespace(cluster: Cluster) -> None:
    operator = OperatorProcess(cluster.operator_kubeconfig, policy_interval_s=1.0)
    try:
        run_opt_in_scenario(cluster.core, cluster.custom, operator.wait_for)
    finally:
        log = operator.stop()
    # kopf retries its first watch while a fresh API server's storage initializes (HTTP 429).
    problems = [
        line
        for line in log.splitlines()
        if (" ERROR " in line and "will retry" not in line) or "Traceback" in line
    ]
    assert not problems, log
    # Every call the policies made was allowed by the chart's RBAC (a 403 is logged).
    assert "HTTP 403" not in log, log


def test_the_garbage_collector_deletes_a_policy_made_job_with_its_workload(
    cluster: Cluster,
) -> None:
    """The job's owner reference is the workload's: with the operator stopped (so that only the
    garbage collector can act), deleting the workload marks the job for deletion; the
    operator, back, runs its finalizer and it is gone."""
    namespace, policy = "ml-gc", "gc-check"
    cluster.core.create_namespace(
        {"metadata": {"name": namespace, "labels": {"perseus.energy/gc-check": "true"}}}
    )
    selector = {"matchLabels": {"perseus.energy/gc-check": "true"}}
    custom = cluster.custom
    custom.create_cluster_custom_object(
        GROUP, VERSION, POLICY_PLURAL, policy_body(policy, namespaceSelector=selector)
    )
    create_workload(custom, pytorch_job("llama"), namespace)
    operator = OperatorProcess(cluster.operator_kubeconfig, policy_interval_s=1.0)
    try:
        job = operator.wait_for(
            "the policy-made job, taken up by the operator (its finalizer set)",
            lambda: (
                (j := perseus_jobs(custom, namespace).get("llama"))
                and j["metadata"].get("finalizers")
                and j
            ),
        )
    finally:
        operator.stop()
    (owner,) = job["metadata"]["ownerReferences"]
    assert owner["kind"] == "PyTorchJob" and owner["name"] == "llama"

    delete_workload(custom, "PyTorchJob", namespace, "llama")
    deadline = time.monotonic() + GC_TIMEOUT_S
    while not perseus_jobs(custom, namespace)["llama"]["metadata"].get("deletionTimestamp"):
        assert time.monotonic() < deadline, "the garbage collector did not delete the job"
        time.sleep(0.2)

    operator = OperatorProcess(cluster.operator_kubeconfig, policy_interval_s=1.0)
    try:
        operator.wait_for("the job's finalizer to run", lambda: not perseus_jobs(custom, namespace))
        custom.delete_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, policy)
    finally:
        operator.stop()
