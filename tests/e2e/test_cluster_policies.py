"""Cluster-wide PerseusPolicies on a real kube-apiserver: the CRD refuses malformed policies
with the rule's words, and the operator, as its own service account (the chart's RBAC), runs
the opt-in scenario (:mod:`policy_scenario`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster_harness import Cluster
from operator_harness import OperatorProcess
from policy_scenario import policy_body, run_opt_in_scenario

pytestmark = pytest.mark.e2e

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
