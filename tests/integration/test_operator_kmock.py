"""The operator process (``python -m perseus_operator.main``) against kmock's Kubernetes API:
create → profile (agents simulated) → optimize → plans written → straggler → re-target →
recover → delete with reset. Malformed jobs created beside it are each reported precisely and
do not disturb it."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from support.kmock_server import KmockServer
from support.malformed_jobs import MALFORMED, malformed
from support.operator_harness import (
    JOBS,
    PLANS,
    RESOURCES,
    OperatorProcess,
    SimulatedAgents,
    operator_problems,
    perseus_job,
    pod,
    profile_of,
)

NS = "ml"
STAGES, DP, MICROBATCHES, GPUS_PER_POD = 4, 2, 8, 4
JOB_SELECTOR = f"{resources.JOB_LABEL}=gpt3"
"""The label selector of the job's node plans."""


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except (OSError, urllib.error.URLError):
        return 0, ""


def metric(text: str, line_start: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def job_body(name: str) -> dict[str, Any]:
    return perseus_job(name, NS, "gpt3", stages=STAGES, dp=DP, microbatches=MICROBATCHES)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KmockServer, Path]]:
    with KmockServer(RESOURCES) as server:
        yield server, server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)


@pytest.fixture
def operator(cluster: tuple[KmockServer, Path]) -> Iterator[OperatorProcess]:
    process = OperatorProcess(cluster[1])
    yield process
    process.stop()


def test_operator_runs_a_job_through_its_life(
    cluster: tuple[KmockServer, Path], operator: OperatorProcess
) -> None:
    server, kubeconfig = cluster
    client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    wait_for = operator.wait_for
    for index in range(2):
        core.create_namespaced_pod(NS, pod("gpt3", index, NS, GPUS_PER_POD))

    def job(name: str = "gpt3") -> dict[str, Any]:
        return server.objects(JOBS).get((NS, name)) or {}

    def plans() -> dict[str, dict[str, Any]]:
        return {name: obj["spec"] for (_, name), obj in server.objects(PLANS).items()}

    def plan_of_replicas() -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for spec in plans().values():
            for a in spec["assignments"]:
                out.setdefault(a["dpRank"], set()).add(a["plan"])
        return out

    def saved_joules() -> float:
        text = get(operator.metrics_port, "/metrics")[1]
        return (
            metric(
                text, 'perseus_job_energy_saved_joules_total{job_name="gpt3",job_namespace="ml"}'
            )
            or 0
        )

    custom.create_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NS, "perseusjobs", job_body("gpt3")
    )
    # Malformed jobs (the in-memory API does not apply the CRD's schema): each is reported
    # precisely, and the good job goes on.
    for case, mutation, _, _ in MALFORMED:
        bad = job_body(f"bad-{case}")
        bad["spec"] = malformed(bad["spec"], mutation)
        custom.create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NS, "perseusjobs", bad
        )
    with SimulatedAgents(custom, NS, profile_of(STAGES), jobs={"gpt3"}) as agents:
        wait_for(
            "the profiling plans",
            lambda: len(plans()) == 2 and all(p.get("profiling") for p in plans().values()),
        )
        status = wait_for(
            "Running", lambda: job().get("status", {}).get("phase") == "Running" and job()["status"]
        )
        for case, _, phase, message in MALFORMED:
            verdict = wait_for(f"{case}'s verdict", lambda c=case: job(f"bad-{c}").get("status"))
            assert verdict["phase"] == phase, case
            assert message in verdict["message"], (case, verdict["message"])

        assert server.objects("v1/configmaps").get((NS, "gpt3-profile")) is not None
        assert plan_of_replicas() == {0: {"tmin"}, 1: {"tmin"}}
        t_min = status["frontier"]["tMinSeconds"]
        assert status["plan"]["targetIterationSeconds"] == pytest.approx(t_min)
        agents.t_min_s["gpt3"] = t_min
        wait_for(
            "PlanApplied",
            lambda: any(
                c["type"] == "PlanApplied" and c["status"] == "True"
                for c in job()["status"].get("conditions", [])
            ),
        )

        # The reconciles read the pods and the job's node plans from kopf's indexes: over a
        # few timer ticks (0.5 s), none of them lists either from the API (kopf's own lists
        # and the agents' carry no such selector), though they did reconcile (the energy saved
        # counts the iterations the agents report).
        served, saved_before = len(server.requests()), saved_joules()
        time.sleep(2.5)

        def own_lists(since: int) -> list[tuple[str, str]]:
            return [
                (plural, params["labelSelector"])
                for action, plural, params in server.requests()[since:]
                if action == "list" and params.get("labelSelector") in ("app=gpt3", JOB_SELECTOR)
            ]

        assert own_lists(served) == []
        assert saved_joules() > saved_before
        # Such lists do show in the log: the job's plans read back right after it wrote them.
        assert (resources.NODE_PLAN_PLURAL, JOB_SELECTOR) in own_lists(0)

        agents.slow = {1: 1.2}
        wait_for("the straggler", lambda: job()["status"].get("stragglers"))
        wait_for("re-targeted plans", lambda: plan_of_replicas().get(0) == {"retargeted"})
        assert plan_of_replicas()[1] == {"tmin"}

        agents.slow = {}
        wait_for("the recovery", lambda: plan_of_replicas() == {0: {"tmin"}, 1: {"tmin"}})
        wait_for("the status to follow", lambda: job()["status"]["stragglers"] == [])

        # The operator's own endpoints.
        assert get(operator.liveness_port, "/healthz")[0] == 200
        status_code, text = get(operator.metrics_port, "/metrics")
        assert status_code == 200
        assert metric(text, 'perseus_jobs{phase="Running"}') == 1.0
        assert metric(text, 'perseus_jobs{phase="Failed"}') == sum(
            1 for _, _, phase, _ in MALFORMED if phase == "Failed"
        )
        assert (
            metric(text, 'perseus_straggler_events_total{job_name="gpt3",job_namespace="ml"}')
            == 1.0
        )
        saved = metric(
            text, 'perseus_job_expected_savings_ratio{job_name="gpt3",job_namespace="ml"}'
        )
        assert saved is not None and 0 < saved < 0.5
        saved_j = metric(
            text, 'perseus_job_energy_saved_joules_total{job_name="gpt3",job_namespace="ml"}'
        )
        assert saved_j is not None and saved_j > 0  # the agents counted iterations
        assert (metric(text, "perseus_planner_seconds_count") or 0) >= 1

        custom.delete_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NS, "perseusjobs", "gpt3"
        )
        wait_for("the job to go", lambda: not job())
        assert plans() == {}  # emptied, confirmed by the agents, then deleted
        assert not agents.errors

    events = [
        e for e in server.objects("v1/events").values() if e["involvedObject"]["name"] == "gpt3"
    ]
    reasons = {e["reason"] for e in events}
    assert {
        "Phase",
        "Profiled",
        "PlanWritten",
        "StragglerDetected",
        "StragglerRecovered",
    } <= reasons
    log = operator.stop()
    problems = operator_problems(log)
    assert not problems, log
