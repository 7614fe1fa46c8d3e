"""The :class:`~perseus_operator.jobs.job_observation.JobIO` of an in-memory cluster, and the node
agents' side of it: the reports they write on the node plans of :mod:`support.lifecycle_job`'s
job."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from perseus_api import resources
from perseus_api.job import WorkloadKind
from perseus_api.node_report import RankReport
from perseus_operator.cluster.kube.client import KubeError
from perseus_operator.jobs.running_decisions import expected_iteration_s
from support.lifecycle_job import JOB, NODES, NS, PROFILE
from support.operator_harness import agent_status, profiled


class FakeCluster:
    """The :class:`~perseus_operator.jobs.job_observation.JobIO` of an in-memory cluster."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.workloads: dict[tuple[str, str], dict[str, Any]] = {}
        self.config_maps: dict[tuple[str, str], dict[str, Any]] = {}
        self.node_plans: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.writes = 0
        self.calls: list[tuple[str, str]] = []
        self.plans_written: list[dict[str, Any]] = []
        """Every node plan spec ever written, in order."""

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for p in self.pods if p["metadata"]["namespace"] == namespace]

    async def get_workload(
        self, namespace: str, kind: WorkloadKind, name: str
    ) -> dict[str, Any] | None:
        return self.workloads.get((namespace, name))

    async def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.config_maps.get((namespace, name)))

    async def put_config_map(
        self,
        namespace: str,
        name: str,
        data: Mapping[str, str],
        owner: Mapping[str, Any],
        annotations: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.config_maps[(namespace, name)] = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "ownerReferences": [owner],
                "labels": dict(labels or {}),
                "creationTimestamp": f"2026-12-01T00:00:{len(self.config_maps):02d}Z",
            },
            "data": dict(data),
        }

    async def list_config_maps(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls.append(("list_config_maps", selector))
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        return [
            copy.deepcopy(cm)
            for (ns, _), cm in sorted(self.config_maps.items())
            if ns == namespace
            and all(cm["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]

    async def get_node(self, name: str) -> dict[str, Any] | None:
        self.calls.append(("get_node", name))
        return copy.deepcopy(self.nodes.get(name))

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]:
        listed = []
        for (ns, _), p in sorted(self.node_plans.items()):
            if ns == namespace and p["metadata"]["labels"][resources.JOB_LABEL] == job:
                obj = copy.deepcopy(p)
                # Changes with every write, the agents' status writes too (tests set a status
                # in place): the operator reads a status once per version.
                content = json.dumps(p, sort_keys=True, default=str).encode()
                version = f"{self.writes}-{hashlib.sha256(content).hexdigest()[:12]}"
                obj["metadata"].update(resourceVersion=version, uid=f"uid-{ns}")
                listed.append(obj)
        return listed

    async def list_node_plans_on(
        self, namespace: str, nodes: Collection[str]
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(p)
            for (ns, _), p in sorted(self.node_plans.items())
            if ns == namespace and p["spec"]["node"] in nodes
        ]

    async def list_jobs(self, namespace: str | None, selector: str = "") -> list[dict[str, Any]]:
        return [copy.deepcopy(j) for (ns, _), j in sorted(self.jobs.items()) if ns == namespace]

    async def put_node_plan(self, body: Mapping[str, Any], owner: Mapping[str, Any]) -> None:
        if "resourceVersion" in body["metadata"]:  # as kube-apiserver does, on create
            raise KubeError("resourceVersion should not be set on objects to be created", 500)
        key = resources.object_key(body)
        current = self.node_plans.get(key, {})
        self.node_plans[key] = {
            **copy.deepcopy(dict(body)),
            "status": current.get("status", {}),
        }
        self.node_plans[key]["metadata"]["ownerReferences"] = [owner]
        self.writes += 1
        self.plans_written.append(copy.deepcopy(dict(body["spec"])))

    async def delete_node_plan(self, namespace: str, name: str) -> None:
        self.node_plans.pop((namespace, name), None)

    # -- the agents' side --

    def report(self, node: str, **status: Any) -> None:
        key = (NS, resources.node_plan_name(JOB, node))
        self.node_plans[key]["status"] = status

    def spec(self, node: str) -> dict[str, Any]:
        spec: dict[str, Any] = self.node_plans[(NS, resources.node_plan_name(JOB, node))]["spec"]
        return spec


def profiling_reports(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What an agent reports once every GPU of its node plan is profiled: the real profile's
    rows of each GPU's stage."""
    return [profiled(a, PROFILE) for a in spec["assignments"]]


def now_rfc3339(age_s: float = 0.0) -> str:
    """As agents write ``reportedAt``: fine enough that every report has its own time."""
    return (datetime.now(tz=UTC) - timedelta(seconds=age_s)).isoformat(timespec="microseconds")


def report_iterations(
    cluster: FakeCluster,
    slow_dp: dict[int, float],
    t_s: float,
    *,
    age_s: float = 0.0,
    legacy: bool = False,
) -> None:
    """Every agent applied the current revision and reports its ranks' mean iteration time
    under it: ``t_s`` times the replica's factor, and times how much slower than the job's
    fastest plan the rank's own plan is meant to run (a re-targeted replica runs at ``T'``).
    ``legacy``: the agents write the snake_case keys of agents before the status model."""
    expected = {node: expected_iteration_s({"spec": cluster.spec(node)}) for node in NODES}
    fastest_s = min(s for e in expected.values() for s in e.values())
    for node in NODES:
        spec = cluster.spec(node)
        ranks = []
        for a in spec["assignments"]:
            time_s = t_s * slow_dp.get(a["dpRank"], 1.0) * expected[node][a["rank"]] / fastest_s
            ranks.append(
                RankReport(
                    rank=a["rank"],
                    dp_rank=a["dpRank"],
                    pp_rank=a["stage"],
                    iterations=50,
                    last_iteration_s=time_s,
                    mean_iteration_s=time_s,
                    revision=spec["revision"],
                )
            )
        status = agent_status(
            spec["revision"], ranks=ranks, reported_at=now_rfc3339(age_s), legacy=legacy
        )
        cluster.report(node, **status)
