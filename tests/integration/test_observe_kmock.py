"""The operator process against kmock: an ``Observe`` job writes no node plan, ever (checked
in the API server's request log), and says how to get a profile; a ``Stage`` job whose
training processes never call in ends with ``NoTrainingProcess`` instead of profiling for
ever."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from support.kmock_server import KmockServer
from support.operator_harness import (
    JOBS,
    PLANS,
    RESOURCES,
    OperatorProcess,
    cut_profile,
    operator_problems,
    perseus_job,
    pod,
)

NS = "ml"
STAGES, DP, MICROBATCHES, GPUS_PER_POD = 4, 2, 8, 4
WRITES = {"POST", "PUT", "PATCH"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KmockServer, Path]]:
    with KmockServer(RESOURCES) as server:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


def node_plan_writes(server: KmockServer) -> list[tuple[str, str, Any]]:
    """Every write request to PerseusNodePlans: (method, name, body)."""

    def collect(emulator: Any) -> list[tuple[str, str, Any]]:
        out = []
        for request in emulator:
            resource = request.resource
            if resource is None or resource.plural != resources.NODE_PLAN_PLURAL:
                continue
            method = getattr(request.method, "value", str(request.method)).upper()
            if method in WRITES:
                data = request.data if isinstance(request.data, dict) else {}
                name = request.name or (data.get("metadata") or {}).get("name", "")
                out.append((method, name, data))
        return out

    result: list[tuple[str, str, Any]] = server.call(collect)
    return result


def test_observe_writes_no_node_plan_and_stage_without_hooks_ends(
    cluster: tuple[KmockServer, Path],
) -> None:
    server, kubeconfig = cluster
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    for app in ("watch", "stage"):
        for index in range(2):
            core.create_namespaced_pod(NS, pod(app, index, NS, GPUS_PER_POD))

    def job(name: str) -> dict[str, Any]:
        return server.objects(JOBS).get((NS, name)) or {}

    def condition(name: str, kind: str) -> dict[str, Any]:
        found = [c for c in job(name).get("status", {}).get("conditions", []) if c["type"] == kind]
        return found[0] if found else {}

    watch = perseus_job("watch", NS, "watch", stages=STAGES, dp=DP, microbatches=MICROBATCHES)
    watch["spec"]["policy"]["mode"] = "Observe"
    stage = perseus_job("stage", NS, "stage", stages=STAGES, dp=DP, microbatches=MICROBATCHES)
    stage["spec"]["policy"].update(mode="Intrinsic", granularity="Stage")
    stage["spec"]["profiling"]["trainingProcessTimeoutSeconds"] = 3
    operator = OperatorProcess(kubeconfig)
    try:
        for body in (watch, stage):
            custom.create_namespaced_custom_object(
                resources.GROUP, resources.VERSION, NS, "perseusjobs", body
            )
        required = operator.wait_for(
            "ProfileRequired",
            lambda: (
                condition("watch", "Profiled").get("reason") == "ProfileRequired"
                and condition("watch", "Profiled")
            ),
        )
        assert "spec.profiling.profileInObserve: true" in required["message"]
        assert job("watch")["status"]["phase"] == "Pending"

        # No agent runs: nobody ever calls in to the Stage job's profiling plans.
        operator.wait_for("the profiling plans", lambda: server.objects(PLANS))
        failed = operator.wait_for(
            "NoTrainingProcess", lambda: job("stage").get("status", {}).get("phase") == "Failed"
        )
        message = job("stage")["status"]["message"]
        assert failed and "no training process called the node agent within 3 s" in message
        for index in range(2):
            ranks = ", ".join(str(4 * index + r) for r in range(4))
            assert f"stage-{index} (ranks {ranks} on node stage-node-{index}" in message
        assert condition("stage", "Profiled")["reason"] == "NoTrainingProcess"
        operator.wait_for("the profiling plans to go", lambda: not server.objects(PLANS))

        # The way the message names: a stored profile; Observe plans from it, writes nothing.
        core.create_namespaced_config_map(
            NS, {"metadata": {"name": "kept"}, "data": {"profile.csv": cut_profile(STAGES)}}
        )
        custom.patch_namespaced_custom_object(
            resources.GROUP,
            resources.VERSION,
            NS,
            "perseusjobs",
            "watch",
            {"spec": {"profiling": {"profileRef": {"configMapName": "kept"}}}},
        )
        operator.wait_for(
            "Running", lambda: job("watch").get("status", {}).get("phase") == "Running"
        )
        status = job("watch")["status"]
        assert status["frontier"]["profileConfigMap"] == "kept"
        assert status["plan"]["expectedSavingsRatio"] > 0
        assert condition("watch", "PlanApplied")["reason"] == "Observe"
        for name in ("watch", "stage"):
            custom.delete_namespaced_custom_object(
                resources.GROUP, resources.VERSION, NS, "perseusjobs", name
            )
        operator.wait_for("the jobs to go", lambda: not job("watch") and not job("stage"))
    finally:
        log = operator.stop()

    writes = node_plan_writes(server)
    assert writes and all(name.startswith("stage-") for _, name, _ in writes), (
        writes
    )  # the Stage job's plans: the log sees writes; none is the Observe job's
    events = {
        (e["involvedObject"]["name"], e["reason"]) for e in server.objects("v1/events").values()
    }
    assert {("watch", "ProfileRequired"), ("stage", "NoTrainingProcess")} <= events
    problems = operator_problems(log)
    assert not problems, log
