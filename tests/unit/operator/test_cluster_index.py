"""Reconcile and policy rounds read pods and node plans from the watch indexes
(:mod:`perseus_operator.cluster.cluster_index`), not from the API: a round with the indexes filled
lists nothing; a job's own node plan writes are read back from the API until the index shows
them; selectors select in the index as the API server does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import Any

import pytest

from perseus_api.job import LabelSelector
from perseus_operator.cluster.cluster_index import (
    IndexedJobIO,
    IndexedObject,
    PlanWrites,
    indexed,
    node_plan_entries,
    pod_entries,
)
from perseus_operator.jobs.lifecycle import JobMemo, Outcome, reconcile
from perseus_operator.jobs.planner_pool import InlinePlanner
from perseus_operator.jobs.planning import RETARGETED_PLAN
from perseus_operator.policies.policy_controller import PolicyController
from perseus_operator.workloads.selectors import matches, parse_selector, render_selector
from support.fake_job_io import FakeCluster, profiling_reports, report_iterations
from support.fake_policy_kube import FakeKube, policy
from support.lifecycle_job import JOB, NS, job_body, pod
from support.workload_objects import NAMESPACES

Entries = Callable[[Mapping[str, Any]], dict[Hashable, IndexedObject]]


def index_of(entries: Entries, objects: Iterable[Mapping[str, Any]]) -> dict[Any, list[Any]]:
    index: dict[Any, list[Any]] = {}
    for obj in objects:
        for key, value in entries(obj).items():
            index.setdefault(key, []).append(value)
    return index


class WatchedCluster(FakeCluster):
    """The in-memory cluster with kopf's indexes over it: :meth:`deliver` hands the indexes
    the watch events so far; every list that reaches the API is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.pod_index: dict[Any, list[Any]] = {}
        self.plan_index: dict[Any, list[Any]] = {}
        self.api_lists: list[str] = []

    def deliver(self) -> None:
        # In place: kopf hands the handlers one live index object.
        for index, entries, objects in (
            (self.pod_index, pod_entries, self.pods),
            (self.plan_index, node_plan_entries, self.node_plans.values()),
        ):
            index.clear()
            index.update(index_of(entries, objects))

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.api_lists.append("pods")
        return await super().list_pods(namespace, selector)

    async def list_node_plans(self, namespace: str, job: str) -> list[dict[str, Any]]:
        self.api_lists.append("node plans")
        return await super().list_node_plans(namespace, job)

    async def list_node_plans_on(
        self, namespace: str, nodes: Collection[str]
    ) -> list[dict[str, Any]]:
        self.api_lists.append("node plans on nodes")
        return await super().list_node_plans_on(namespace, nodes)


class IndexedOperator:
    """Runs reconcile as the kopf handlers do: through an :class:`IndexedJobIO` over the
    indexes as they are at the step, the job's unseen writes kept between steps."""

    def __init__(self, cluster: WatchedCluster, body: dict[str, Any]) -> None:
        self.cluster = cluster
        self.body = body
        cluster.jobs[(NS, JOB)] = body
        self.memo = JobMemo()
        self.writes = PlanWrites()

    def io(self) -> IndexedJobIO:
        c = self.cluster
        return IndexedJobIO(
            c,
            job=(NS, JOB),
            pods=c.pod_index,
            node_plans=c.plan_index,
            workloads={},
            writes=self.writes,
        )

    def step(self) -> Outcome:
        outcome = asyncio.run(
            reconcile(self.body, self.io(), InlinePlanner(), self.memo, now_s=time.time())
        )
        self.body["status"] = outcome.status.model_dump(mode="json", by_alias=True)
        if outcome.detector_state is not None:
            self.body["metadata"].setdefault("annotations", {}).update(
                {"perseus.energy/straggler-state": outcome.detector_state}
            )
        return outcome

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.body["status"]
        return status

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == kind)


@pytest.fixture
def cluster() -> WatchedCluster:
    c = WatchedCluster()
    c.pods = [pod(0), pod(1)]
    c.deliver()
    return c


def replicas(cluster: FakeCluster) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for p in cluster.node_plans.values():
        for a in p["spec"]["assignments"]:
            out.setdefault(a["dpRank"], set()).add(a["plan"])
    return out


def test_a_running_job_lists_nothing_from_the_api_once_the_index_shows_its_plans(
    cluster: WatchedCluster,
) -> None:
    op = IndexedOperator(cluster, job_body())
    op.step()  # Pending -> Profiling: the profiling plans written
    assert op.status["phase"] == "Profiling"
    cluster.deliver()
    for node in ("node-0", "node-1"):
        cluster.report(node, profiling=profiling_reports(cluster.spec(node)))
    cluster.deliver()
    cluster.api_lists.clear()
    op.step()  # profiled, planned, plans written: Running
    assert op.status["phase"] == "Running"
    # The profiling plans came from the index; the plans just written were read back from
    # the API (their watch events had not arrived).
    assert cluster.api_lists == ["node plans"]
    cluster.deliver()

    t_min = op.status["frontier"]["tMinSeconds"]
    cluster.api_lists.clear()
    for _ in range(3):
        report_iterations(cluster, {}, t_min)
        cluster.deliver()
        op.step()
    assert op.condition("PlanApplied")["status"] == "True"
    assert cluster.api_lists == []

    # A straggler: detected and re-targeted from the index alone; the re-targeted plans are
    # written to the API.
    revision = op.status["revision"]
    for _ in range(2):
        report_iterations(cluster, {1: 1.2}, t_min)
        cluster.deliver()
        op.step()
    assert op.status["revision"] == revision + 1
    assert replicas(cluster) == {0: {RETARGETED_PLAN}, 1: {"tmin"}}
    assert cluster.api_lists == []
    # Until their watch events arrive, the job's plans come from the API; then from the index.
    report_iterations(cluster, {1: 1.2}, t_min)
    op.step()
    assert cluster.api_lists == ["node plans"]
    cluster.deliver()
    op.step()
    assert cluster.api_lists == ["node plans"]


def test_a_step_reads_back_the_plans_it_wrote_and_deletes_what_it_no_longer_wants(
    cluster: WatchedCluster,
) -> None:
    op = IndexedOperator(cluster, job_body())
    op.step()
    # Writing the profiling plans listed the job's plans from the index (none yet); the same
    # step then read the profiling round from the API, which has them.
    assert cluster.api_lists == ["node plans"]
    assert "0 of 4 pipeline stages measured" in op.status["message"]
    op.step()  # no watch event yet: from the API again
    assert cluster.api_lists == ["node plans"] * 2

    # The workload fails: the step deletes the job's plans (listed from the index, which now
    # shows them), and the API answers for the job's plans until the index shows the deletions.
    cluster.deliver()
    for p in cluster.pods:
        p["status"]["phase"] = "Failed"
    cluster.deliver()
    cluster.api_lists.clear()
    op.step()
    assert op.status["phase"] == "Failed"
    assert cluster.node_plans == {} and cluster.api_lists == []
    io = op.io()
    assert asyncio.run(io.list_node_plans(NS, JOB)) == []  # not the two the index still has
    assert cluster.api_lists == ["node plans"]
    cluster.deliver()
    assert asyncio.run(io.list_node_plans(NS, JOB)) == []
    assert cluster.api_lists == ["node plans"] and not op.writes.pending


def test_a_write_is_shown_by_its_revision_or_a_later_one_of_the_same_owner() -> None:
    def plan(revision: int, uid: str = "uid-1") -> IndexedObject:
        return indexed(
            {
                "metadata": {"name": "p", "ownerReferences": [{"uid": uid}]},
                "spec": {"revision": revision},
            }
        )

    writes = PlanWrites()
    writes.wrote("p", 3, "uid-1")
    assert not writes.shown_in([plan(2)])
    assert not writes.shown_in([plan(3, uid="uid-0")])  # an earlier job of the same name
    assert writes.shown_in([plan(4)]) and not writes.pending
    writes.deleted("p")
    assert not writes.shown_in([plan(4)])
    assert writes.shown_in([])


def test_the_index_leaves_managed_fields_out_and_hands_out_fresh_copies() -> None:
    obj = {
        "metadata": {"name": "a", "namespace": "ml", "managedFields": [{"manager": "x"}]},
        "spec": {"nodeName": "n"},
    }
    entry = indexed(obj)
    first = entry.read()
    assert "managedFields" not in first["metadata"]
    first["spec"]["nodeName"] = "changed"
    assert entry.read()["spec"]["nodeName"] == "n"
    assert obj["metadata"]["managedFields"]  # the watched object itself is left alone


def test_an_object_of_the_watchers_own_types_is_read_as_plain_data() -> None:
    """kopf hands indexes its own Mapping types: they are read back as plain dicts."""
    from types import MappingProxyType

    spec = MappingProxyType({"nodeName": "n", "containers": ({"name": "c"},)})
    obj = {"metadata": {"name": "a", "namespace": "ml"}, "spec": spec}
    read = indexed(obj).read()
    assert read == {
        "metadata": {"name": "a", "namespace": "ml"},
        "spec": {"nodeName": "n", "containers": [{"name": "c"}]},
    }
    assert type(read["spec"]) is dict


def test_pods_are_selected_in_the_index_as_the_api_server_selects_them() -> None:
    def labelled(name: str, namespace: str = "ml", **labels: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": namespace, "labels": labels}}

    pods = [
        labelled("b", app="gpt3", tier="train"),
        labelled("a", app="gpt3"),
        labelled("c", app="bert"),
        labelled("d", namespace="other", app="gpt3"),
    ]
    io = IndexedJobIO(
        FakeCluster(),
        job=("ml", "j"),
        pods=index_of(pod_entries, pods),
        node_plans={},
        workloads={},
        writes=PlanWrites(),
    )

    def names(selector: str, namespace: str = "ml") -> list[str]:
        return [p["metadata"]["name"] for p in asyncio.run(io.list_pods(namespace, selector))]

    assert names("app=gpt3") == ["a", "b"]  # by name, as an API list
    assert names("app in (bert,gpt3),!tier") == ["a", "c"]
    assert names("app notin (gpt3)") == ["c"]
    assert names("tier") == ["b"]
    assert names("app!=gpt3") == ["c"]
    assert names("") == ["a", "b", "c"]
    assert names("app=gpt3", namespace="other") == ["d"]
    assert names("app=gpt3", namespace="none") == []


@pytest.mark.parametrize(
    "selector",
    [
        {"matchLabels": {"app": "gpt3", "training.kubeflow.org/job-name": "x"}},
        {"matchExpressions": [{"key": "app", "operator": "In", "values": ["b", "a"]}]},
        {
            "matchLabels": {"team": "ml"},
            "matchExpressions": [
                {"key": "tier", "operator": "NotIn", "values": ["x", "y"]},
                {"key": "gpu", "operator": "Exists"},
                {"key": "debug", "operator": "DoesNotExist"},
            ],
        },
    ],
)
def test_a_rendered_selector_parses_back_to_itself(selector: dict[str, Any]) -> None:
    model = LabelSelector.model_validate(selector)
    parsed = parse_selector(render_selector(model))
    assert parsed is not None and render_selector(parsed) == render_selector(model)
    for labels in (
        {"app": "a", "team": "ml", "gpu": "1"},
        {"app": "gpt3", "training.kubeflow.org/job-name": "x"},
        {"team": "ml", "tier": "z", "gpu": "", "debug": "1"},
    ):
        assert matches(parsed, labels) == matches(model, labels)


def test_nonsense_is_no_selector() -> None:
    assert parse_selector(" ") is None
    with pytest.raises(ValueError, match="not a label selector"):
        parse_selector(",")


class PodCountingKube(FakeKube):
    def __init__(self) -> None:
        super().__init__([policy()])
        self.pods_listed = 0

    async def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.pods_listed += 1
        return []


def test_policy_rounds_read_pods_from_the_index_once_kopf_has_filled_it() -> None:
    kube = PodCountingKube()
    controller = PolicyController(kube, interval_s=60)  # type: ignore[arg-type]
    asyncio.run(controller.sync())
    listed = kube.pods_listed
    selected = [n for n, labels in NAMESPACES.items() if labels.get("perseus.energy/enabled")]
    assert listed == len(selected) > 0  # before: one list per selected namespace

    controller.read_pods_from({})
    asyncio.run(controller.sync())
    assert kube.pods_listed == listed


def test_a_workload_comes_from_the_index_else_from_the_api() -> None:
    from perseus_api.job import WorkloadKind
    from perseus_operator.cluster.cluster_index import workload_entries

    api = FakeCluster()
    api.workloads[("ml", "asked")] = {"metadata": {"name": "asked"}, "status": {"from": "api"}}
    watched = {"metadata": {"name": "w", "namespace": "ml"}, "status": {"from": "index"}}
    io = IndexedJobIO(
        api,
        job=("ml", "j"),
        pods={},
        node_plans={},
        workloads=index_of(lambda o: workload_entries(WorkloadKind.PYTORCH_JOB, o), [watched]),
        writes=PlanWrites(),
    )

    def get(kind: WorkloadKind, name: str) -> dict[str, Any] | None:
        return asyncio.run(io.get_workload("ml", kind, name))

    assert get(WorkloadKind.PYTORCH_JOB, "w") == watched
    # Not in the index (its kind unwatched, or it is gone): the API says.
    assert get(WorkloadKind.JOB_SET, "w") is None
    assert get(WorkloadKind.PYTORCH_JOB, "asked") == api.workloads[("ml", "asked")]


def test_the_plans_on_a_jobs_nodes_are_what_they_claim_not_their_pipeline_plans(
    cluster: WatchedCluster,
) -> None:
    from perseus_operator.jobs.gpu_conflicts import claims_of_node_plans, planned_gpus

    op = IndexedOperator(cluster, job_body())
    op.step()  # the profiling plans, with the agents' reports on them
    for node in ("node-0", "node-1"):
        cluster.report(node, profiling=profiling_reports(cluster.spec(node)))
    cluster.deliver()
    whole = asyncio.run(op.io().list_node_plans(NS, JOB))
    claims = asyncio.run(op.io().list_node_plans_on(NS, ["node-0", "node-1", "node-9"]))
    assert asyncio.run(op.io().list_node_plans_on(NS, ["node-9"])) == []
    assert len(asyncio.run(op.io().list_node_plans_on(NS, ["node-1"]))) == 1
    assert [p["metadata"]["name"] for p in claims] == [p["metadata"]["name"] for p in whole]
    assert all("plans" not in p["spec"] and "status" not in p for p in claims)
    assert all(p["spec"]["plans"] and p["status"] for p in whole)
    assert planned_gpus(claims) == planned_gpus(whole) != frozenset()
    jobs = list(cluster.jobs.values())
    assert claims_of_node_plans(claims, jobs) == claims_of_node_plans(whole, jobs)
