"""The PodSecurity level the chart's notes and README name for the agent, on the real
kube-apiserver (its PodSecurity admission is on by default): the rendered agent pod is refused
in a namespace enforcing ``baseline`` and admitted where ``privileged`` is enforced, with the
default ``system-node-critical`` priority class (which the API server creates itself)."""

from __future__ import annotations

import json
from typing import Any

from support.cluster_harness import Cluster
from support.helm_render import render


def _agent_pod(namespace: str) -> dict[str, Any]:
    template = render().one("DaemonSet")["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "perseus-agent-probe", "namespace": namespace, **template["metadata"]},
        "spec": {**template["spec"], "nodeName": "gpu-node-1"},
    }


def _namespace(cluster: Cluster, name: str, level: str) -> None:
    label = {"pod-security.kubernetes.io/enforce": level}
    cluster.plane.apply(
        [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": label}}]
    )


def _dry_run_create(cluster: Cluster, namespace: str) -> tuple[int, str]:
    done = cluster.plane.kubectl(
        "create",
        "--dry-run=server",
        "-o",
        "json",
        "-f",
        "-",
        stdin=json.dumps(_agent_pod(namespace)),
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_agent_pod_needs_the_privileged_pod_security_level(cluster: Cluster) -> None:
    _namespace(cluster, "ps-baseline", "baseline")
    _namespace(cluster, "ps-privileged", "privileged")

    status, output = _dry_run_create(cluster, "ps-baseline")
    assert status != 0, output
    assert 'violates PodSecurity "baseline:latest"' in output
    assert "hostPath volumes" in output

    status, output = _dry_run_create(cluster, "ps-privileged")
    assert status == 0, output
    admitted = json.loads(output)
    # The priority admission plugin resolved the default class: it exists on every cluster.
    assert admitted["spec"]["priorityClassName"] == "system-node-critical"
    assert admitted["spec"]["priority"] == 2000001000
