"""The power budget controller (:class:`~perseus_operator.power.budget_controller.
BudgetController`) against kmock's Kubernetes API (issue 35, step 4).

Two running PerseusJobs on two nodes of one rack, their frontiers the real ones the planner
solves for the bundled GPT-3 and Bloom A100 profiles (8 stages x 12 microbatches); their node
plans' statuses carry the GPUs' energy counters as the agents write them, advanced between two
rounds by a known draw. Against that API:

- a budget below the jobs' ``T_min`` draw re-targets at least one job (the annotation its
  reconcile takes), within the planned watts, and the status says Met with each job's watts;
- deleting the budget gives every job ``T_min`` back (the annotation removed);
- a budget below even the slowest points says Infeasible with the watts missing.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes
import pytest

from perseus_api import resources
from perseus_api.conventions import rfc3339
from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.cluster.kube.client import KubeClient, load_api_client
from perseus_operator.jobs.job_decisions import power_target_s
from perseus_operator.metrics import OperatorMetrics
from perseus_operator.power.budget_controller import BudgetController, JobFrontier
from perseus_operator.power.prometheus_draw import PrometheusDraw
from perseus_planner.frontier import Frontier
from perseus_planner.power.frontier_points import frontier_points
from support.kmock_server import KmockServer
from support.operator_harness import RESOURCES, VERBS

GROUP, VERSION = resources.GROUP, resources.VERSION
NAMESPACE = "ml"
GPUS_PER_JOB = 8
BUDGET_RESOURCES: dict[str, dict[str, Any]] = {
    **RESOURCES,
    "v1/nodes": {"kind": "Node", "singular": "node", "namespaced": False, "verbs": VERBS},
    f"{GROUP}/{VERSION}/{BUDGET_PLURAL}": {
        "kind": "PerseusPowerBudget",
        "singular": "perseuspowerbudget",
        "namespaced": False,
        "subresources": {"status"},
        "verbs": VERBS,
    },
}
JOBS = {"gpt3": ("gpt3-175b", "node-a1"), "bloom": ("bloom", "node-a2")}
START_S = 1_800_000_000.0
ROUND_S = 20.0

SolveFrontier = Callable[[str, str, int], Frontier]


@pytest.fixture(scope="module")
def frontiers(solved_frontier: SolveFrontier) -> dict[tuple[str, str], Frontier]:
    return {(NAMESPACE, job): solved_frontier(m, "a100_sxm", 12) for job, (m, _) in JOBS.items()}


def _t_min_w(frontier: Frontier) -> float:
    points, _ = frontier_points("j", frontier, 1)
    return float(points.powers_w[points.times_s.argmin()])


def _least_w(frontier: Frontier) -> float:
    points, _ = frontier_points("j", frontier, 1)
    return float(points.powers_w.min())


class Cluster:
    """kmock with the nodes, jobs and node plans; the controller with a clock the test moves."""

    def __init__(self, kubeconfig: Path, frontiers: dict[tuple[str, str], Frontier]) -> None:
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.client = client
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.core = kubernetes.client.CoreV1Api(client)
        self.now_s = START_S
        self.energy_j = dict.fromkeys(JOBS, 0.0)
        self.kube = KubeClient(load_api_client(str(kubeconfig)))
        self.metrics = OperatorMetrics()
        self.controller = BudgetController(
            self.kube,
            lambda: {key: JobFrontier(f) for key, f in frontiers.items()},
            interval_s=3600,
            metrics=self.metrics,
            now_s=lambda: self.now_s,
        )

    def create(self) -> None:
        self.core.create_namespace({"metadata": {"name": NAMESPACE}})
        for name, rack in (("node-a1", "a"), ("node-a2", "a"), ("node-b1", "b")):
            labels = {"topology.example.com/rack": rack}
            self.core.create_node({"metadata": {"name": name, "labels": labels}})
        for job, (_, node) in JOBS.items():
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "perseusjobs",
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "PerseusJob",
                    "metadata": {"name": job, "namespace": NAMESPACE},
                    "spec": {"parallelism": {"dataParallel": 1, "pipelineStages": 8}},
                },
            )  # fmt: skip
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, NAMESPACE, "perseusjobs", job, {"status": {"phase": "Running"}}
            )
            assignments = [
                {"gpuIndex": i, "plan": "p", "stage": i, "dpRank": 0} for i in range(GPUS_PER_JOB)
            ]
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, resources.NODE_PLAN_PLURAL,
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": resources.NODE_PLAN_KIND,
                    "metadata": {"name": f"{job}-{node}", "namespace": NAMESPACE},
                    "spec": {"node": node, "job": job, "namespace": NAMESPACE,
                             "assignments": assignments},
                },
            )  # fmt: skip

    def report(self, draw_w: dict[str, float]) -> None:
        """The agents' reports ``ROUND_S`` later, each job's GPUs having drawn ``draw_w``."""
        self.now_s += ROUND_S
        for job, (_, node) in JOBS.items():
            self.energy_j[job] += draw_w[job] * ROUND_S
            gpus = [
                {"uuid": f"GPU-{job}-{i}", "index": i, "plan": "p", "stage": i,
                 "status": "Applied", "energyJoules": self.energy_j[job] / GPUS_PER_JOB}
                for i in range(GPUS_PER_JOB)
            ]  # fmt: skip
            status = {"reportedAt": rfc3339(self.now_s), "observedRevision": 1, "gpus": gpus}
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, NAMESPACE, resources.NODE_PLAN_PLURAL, f"{job}-{node}",
                {"status": status},
            )  # fmt: skip

    def budget(self, name: str, budget_w: float) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "PerseusPowerBudget",
            "metadata": {"name": name},
            "spec": {
                "budgetWatts": budget_w,
                "nodeSelector": {"matchLabels": {"topology.example.com/rack": "a"}},
                "averagingWindowSeconds": 60,
                "safetyMarginRatio": 0.05,
            },
        }
        self.custom.create_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, body)

    def status(self, name: str) -> dict[str, Any]:
        obj = self.custom.get_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, name)
        status: dict[str, Any] = obj.get("status") or {}
        return status

    def targets_s(self) -> dict[str, float | None]:
        out = {}
        for job in JOBS:
            obj = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, "perseusjobs", job
            )
            out[job] = power_target_s(obj["metadata"].get("annotations") or {})
        return out

    def sync(self) -> None:
        asyncio.run(self.controller.sync())

    def close(self) -> None:
        self.kube.close()
        self.client.close()


@pytest.fixture
def cluster(tmp_path: Path, frontiers: dict[tuple[str, str], Frontier]) -> Iterator[Cluster]:
    with KmockServer(BUDGET_RESOURCES) as server:
        c = Cluster(server.write_kubeconfig(tmp_path / "kubeconfig"), frontiers)
        try:
            c.create()
            yield c
        finally:
            c.close()


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_budget_below_t_min_retargets_and_is_met_then_deleted_gives_t_min_back(
    cluster: Cluster, frontiers: dict[tuple[str, str], Frontier]
) -> None:
    t_min_w = {job: _t_min_w(frontiers[(NAMESPACE, job)]) for job in JOBS}
    budget_w = 0.95 * sum(t_min_w.values())  # planned for 95 % of it: ~10 % below T_min
    cluster.report(t_min_w)
    cluster.budget("rack-a", budget_w)
    cluster.sync()

    targets = cluster.targets_s()
    assert any(t is not None for t in targets.values()), targets
    status = cluster.status("rack-a")
    assert status["managedJobs"] == 2 and status["nodes"] == 2
    assert {j["name"] for j in status["jobs"]} == set(JOBS)
    assert all(j["gpus"] == GPUS_PER_JOB for j in status["jobs"])
    assert status["allocatedWatts"] <= 0.95 * budget_w + 0.1
    assert sum(j["allocatedWatts"] for j in status["jobs"]) == pytest.approx(
        status["allocatedWatts"], abs=0.2
    )
    slowed = [j for j in status["jobs"] if j["slowdownRatio"] > 0]
    assert slowed and all(targets[j["name"]] is not None for j in slowed)
    assert _condition(status, "Infeasible")["status"] == "False"
    # One report so far: no draw over the window yet.
    assert _condition(status, "Met")["status"] == "Unknown"

    # The jobs now draw what they were allocated: the draw is measured and within budget.
    allocated = {j["name"]: j["allocatedWatts"] for j in status["jobs"]}
    cluster.report(allocated)
    cluster.sync()
    status = cluster.status("rack-a")
    assert status["measuredWatts"] == pytest.approx(sum(allocated.values()), rel=1e-3)
    assert status["headroomWatts"] == pytest.approx(budget_w - status["measuredWatts"], abs=0.2)
    assert _condition(status, "Met")["status"] == "True"
    assert cluster.targets_s() == targets  # nothing changed: no plan rewritten
    registry = cluster.metrics.registry
    assert registry.get_sample_value("perseus_power_budget_watts", {"budget": "rack-a"}) == (
        budget_w
    )
    labels = {"budget": "rack-a", "job_namespace": NAMESPACE, "job_name": slowed[0]["name"]}
    value = registry.get_sample_value("perseus_power_budget_job_slowdown_ratio", labels)
    assert value == pytest.approx(slowed[0]["slowdownRatio"])

    # A draw over the budget (the jobs' plans not in effect yet) reads as not met.
    cluster.report({job: 1.2 * w for job, w in t_min_w.items()})
    cluster.sync()
    assert _condition(cluster.status("rack-a"), "Met")["status"] == "False"

    cluster.custom.delete_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, "rack-a")
    cluster.sync()
    assert cluster.targets_s() == dict.fromkeys(JOBS)
    registry = cluster.metrics.registry
    assert registry.get_sample_value("perseus_power_budget_watts", {"budget": "rack-a"}) is None


def test_infeasible_budget_says_the_missing_watts(
    cluster: Cluster, frontiers: dict[tuple[str, str], Frontier]
) -> None:
    least_w = sum(_least_w(frontiers[(NAMESPACE, job)]) for job in JOBS)
    budget_w = 0.5 * least_w
    cluster.budget("rack-a", budget_w)
    cluster.sync()
    status = cluster.status("rack-a")
    infeasible = _condition(status, "Infeasible")
    assert infeasible["status"] == "True"
    assert status["missingWatts"] == pytest.approx(least_w - 0.95 * budget_w, abs=0.2)
    assert f"{status['missingWatts']:.0f} W missing" in infeasible["message"]
    # Every job runs its least-power point, the closest the domain can come.
    assert all(t is not None for t in cluster.targets_s().values())
    assert status["allocatedWatts"] == pytest.approx(least_w, abs=0.2)


def test_a_node_of_another_rack_and_a_job_there_are_left_out(cluster: Cluster) -> None:
    """The selector decides the domain: a budget for rack b (no job there) re-targets nothing."""
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PerseusPowerBudget",
        "metadata": {"name": "rack-b"},
        "spec": {
            "budgetWatts": 100.0,
            "nodeSelector": {"matchLabels": {"topology.example.com/rack": "b"}},
        },
    }
    cluster.custom.create_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, body)
    cluster.sync()
    status = cluster.status("rack-b")
    assert status["nodes"] == 1 and status["managedJobs"] == 0
    assert cluster.targets_s() == dict.fromkeys(JOBS)


# -- the draw from Prometheus: unmanaged GPUs at their measured draw; the budget's Events --


class _PrometheusStandIn:
    """Answers the controller's draw query as a Prometheus scraping the rack's agents would:
    each job's GPUs, and GPUs no PerseusJob manages (``down``: the server refuses)."""

    def __init__(self) -> None:
        self.series: list[tuple[dict[str, str], float]] = []
        self.queries: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stand_in.queries += parse_qs(urlsplit(self.path).query).get("query", [])
                result = [{"metric": m, "value": [START_S, str(w)]} for m, w in stand_in.series]
                body = json.dumps(
                    {"status": "success", "data": {"resultType": "vector", "result": result}}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _with_draw(cluster: Cluster, url: str, frontiers: dict[tuple[str, str], Frontier]) -> None:
    cluster.controller = BudgetController(
        cluster.kube,
        lambda: {key: JobFrontier(f) for key, f in frontiers.items()},
        interval_s=3600,
        now_s=lambda: cluster.now_s,
        draw=PrometheusDraw(url, timeout_s=2.0),
        events_namespace="perseus-system",
    )


def _events(cluster: Cluster) -> list[dict[str, Any]]:
    response = cluster.core.list_namespaced_event("perseus-system", _preload_content=False)
    items: list[dict[str, Any]] = json.loads(response.data).get("items") or []
    return items


def test_unmanaged_gpus_count_at_their_draw_from_prometheus_and_events_go_on_the_budget(
    cluster: Cluster, frontiers: dict[tuple[str, str], Frontier]
) -> None:
    """Idle GPUs of rack a that no PerseusJob manages draw 1,500 W: the budget plans around
    them (the jobs get that much less), and another rack's GPUs do not count at all."""
    t_min_w = {job: _t_min_w(frontiers[(NAMESPACE, job)]) for job in JOBS}
    unmanaged_w = 1500.0
    prometheus = _PrometheusStandIn()
    try:
        prometheus.series = [
            *(({"node": node, "job_namespace": NAMESPACE, "job_name": job}, t_min_w[job])
              for job, (_, node) in JOBS.items()),
            ({"node": "node-a1", "gpu": "7"}, 1000.0),  # no job: the label is absent
            ({"node": "node-a2"}, 500.0),
            ({"node": "node-b1"}, 9000.0),  # rack b
        ]  # fmt: skip
        cluster.core.create_namespace({"metadata": {"name": "perseus-system"}})
        _with_draw(cluster, prometheus.url, frontiers)
        budget_w = (sum(t_min_w.values()) + unmanaged_w) / 0.95 * 0.9
        cluster.budget("rack-a", budget_w)
        cluster.sync()
        status = cluster.status("rack-a")
        assert status["unmanagedWatts"] == pytest.approx(unmanaged_w, abs=0.1)
        assert status["measuredWatts"] == pytest.approx(sum(t_min_w.values()) + unmanaged_w, 1e-3)
        assert status["allocatedWatts"] <= 0.95 * budget_w - unmanaged_w + 0.1
        assert prometheus.queries == [
            "sum by (node, job_namespace, job_name) (rate(perseus_gpu_energy_joules_total[60s]))"
        ]
        events = _events(cluster)
        assert {e["reason"] for e in events} == {"Resolved", "Retargeted"}
        for event in events:
            assert event["involvedObject"]["kind"] == "PerseusPowerBudget"
            assert event["involvedObject"]["name"] == "rack-a"
        cluster.sync()  # a steady round: nothing new to say
        assert len(_events(cluster)) == len(events)
    finally:
        prometheus.close()


def test_without_an_answer_from_prometheus_the_reports_measure_the_draw(
    cluster: Cluster, frontiers: dict[tuple[str, str], Frontier]
) -> None:
    prometheus = _PrometheusStandIn()
    prometheus.close()  # nothing listens there any more
    _with_draw(cluster, prometheus.url, frontiers)
    t_min_w = {job: _t_min_w(frontiers[(NAMESPACE, job)]) for job in JOBS}
    cluster.report(t_min_w)
    cluster.budget("rack-a", 2 * sum(t_min_w.values()))
    cluster.sync()
    cluster.report(t_min_w)
    cluster.sync()
    status = cluster.status("rack-a")
    assert status["measuredWatts"] == pytest.approx(sum(t_min_w.values()), rel=1e-3)
    assert status["unmanagedWatts"] == 0
