"""Observe changes no clock, ever; Stage without client hooks never profiles for ever.

Through :func:`perseus_operator.jobs.lifecycle.reconcile` against the in-memory cluster of
:mod:`support.fake_job_io`: every node plan the operator ever writes is recorded
(``FakeCluster.plans_written``), so "no clock moved" is "no node plan with a profiling sweep
or a plan was ever written"."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from perseus_operator.jobs.lifecycle import JobMemo, Outcome, reconcile
from perseus_operator.jobs.phase_decisions import profile_config_map_name
from perseus_operator.jobs.planner_pool import InlinePlanner
from perseus_operator.jobs.profile_source import (
    GPU_PRODUCT_LABEL,
    MODEL_LABEL,
    NODE_GPU_PRODUCT_LABEL,
)
from support.fake_job_io import FakeCluster, profiling_reports
from support.lifecycle_job import NS, job_body, pod

A100 = "NVIDIA-A100-SXM4-80GB"


class Job:
    """One PerseusJob reconciled as the kopf handlers do, at a time the test chooses."""

    def __init__(self, cluster: FakeCluster, body: dict[str, Any]) -> None:
        self.cluster, self.body, self.memo = cluster, body, JobMemo()
        self.name = body["metadata"]["name"]
        cluster.jobs[(NS, self.name)] = body
        self.events: list[tuple[str, str, str]] = []

    def step(self, now_s: float | None = None) -> Outcome:
        outcome = asyncio.run(
            reconcile(
                self.body,
                self.cluster,
                InlinePlanner(),
                self.memo,
                now_s=time.time() if now_s is None else now_s,
            )
        )
        self.body["status"] = outcome.status.model_dump(mode="json", by_alias=True)
        self.events += [(e.type, e.reason, e.message) for e in outcome.events]
        return outcome

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.body["status"]
        return status

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == kind)

    def plans_written(self) -> list[dict[str, Any]]:
        return [s for s in self.cluster.plans_written if s["job"] == self.name]


def named(name: str, app: str, **policy: Any) -> dict[str, Any]:
    body = job_body(**policy)
    body["metadata"].update(name=name, uid=f"uid-{name}")
    body["spec"]["workload"]["podSelector"] = {"matchLabels": {"app": app}}
    return body


def pods_of(app: str, nodes: tuple[str, str]) -> list[dict[str, Any]]:
    out = []
    for index, node in enumerate(nodes):
        p = pod(index, node=node)
        p["metadata"].update(name=f"{app}-{index}", labels={"app": app})
        out.append(p)
    return out


def gpu_nodes(cluster: FakeCluster, product: str, *names: str) -> None:
    for name in names:
        cluster.nodes[name] = {
            "metadata": {"name": name, "labels": {NODE_GPU_PRODUCT_LABEL: product}}
        }


def report_all(cluster: FakeCluster, job: str) -> None:
    """Every agent of ``job`` finished profiling its GPUs."""
    for (ns, _), plan in cluster.node_plans.items():
        if ns == NS and plan["spec"]["job"] == job:
            plan["status"] = {"profiling": profiling_reports(plan["spec"])}


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


# -- Observe -----------------------------------------------------------------------------------


def test_observe_without_a_profile_changes_no_clock_and_says_how_to_get_one(
    cluster: FakeCluster,
) -> None:
    cluster.pods = pods_of("gpt3", ("node-0", "node-1"))
    job = Job(cluster, named("gpt3", "gpt3", mode="Observe"))
    for _ in range(3):
        job.step()
    assert job.plans_written() == []  # no profiling sweep, no plan: no clock moved
    assert job.status["phase"] == "Pending"
    profiled = job.condition("Profiled")
    assert (profiled["status"], profiled["reason"]) == ("False", "ProfileRequired")
    for how in ("spec.profiling.profileRef", "spec.profiling.model", "profileInObserve: true"):
        assert how in profiled["message"]
    assert job.status["message"] == profiled["message"]
    warnings = [e for e in job.events if e[1] == "ProfileRequired"]
    assert [w[0] for w in warnings] == ["Warning"]  # once, not at every tick


def test_observe_plans_from_a_profile_an_earlier_job_of_the_same_model_stored(
    cluster: FakeCluster,
) -> None:
    gpu_nodes(cluster, A100, "node-0", "node-1", "node-2", "node-3")
    cluster.pods = pods_of("first", ("node-0", "node-1")) + pods_of("later", ("node-2", "node-3"))
    first = Job(cluster, named("first", "first", mode="Intrinsic"))
    first.body["spec"]["profiling"]["model"] = "gpt3-175b"
    first.step()
    assert first.status["phase"] == "Profiling"  # Intrinsic may change clocks: it profiles
    report_all(cluster, "first")
    first.step()
    assert first.status["phase"] == "Running"
    stored = cluster.config_maps[(NS, profile_config_map_name("first"))]
    assert stored["metadata"]["labels"] == {MODEL_LABEL: "gpt3-175b", GPU_PRODUCT_LABEL: A100}

    later = Job(cluster, named("later", "later", mode="Observe"))
    later.body["spec"]["profiling"]["model"] = "gpt3-175b"
    later.step()
    assert later.status["phase"] == "Running", later.status
    assert later.plans_written() == []
    assert later.status["frontier"]["profileConfigMap"] == "first-profile"
    assert later.condition("Profiled")["reason"] == "ProfileFound"
    assert later.condition("PlanApplied")["reason"] == "Observe"
    assert later.status["plan"]["expectedSavingsRatio"] > 0
    # A restarted operator finds it again (no memo), still writing nothing.
    restarted = Job(cluster, later.body)
    restarted.step()
    assert restarted.status["phase"] == "Running" and restarted.plans_written() == []


@pytest.mark.parametrize(
    ("model", "product", "says"),
    [
        ("llama-70b", A100, "run a job of model llama-70b on NVIDIA-A100-SXM4-80GB GPUs"),
        ("gpt3-175b", "NVIDIA-H100-80GB-HBM3", "on NVIDIA-H100-80GB-HBM3 GPUs"),
        ("gpt3-175b", None, f"label the job's nodes with {NODE_GPU_PRODUCT_LABEL}"),
    ],
    ids=["other-model", "other-gpu", "gpu-unknown"],
)
def test_observe_uses_no_profile_of_another_model_or_gpu(
    cluster: FakeCluster, model: str, product: str | None, says: str
) -> None:
    gpu_nodes(cluster, A100, "node-0", "node-1")
    cluster.pods = pods_of("first", ("node-0", "node-1")) + pods_of("later", ("node-2", "node-3"))
    if product is not None:
        gpu_nodes(cluster, product, "node-2", "node-3")
    first = Job(cluster, named("first", "first"))
    first.body["spec"]["profiling"]["model"] = "gpt3-175b"
    first.step()
    report_all(cluster, "first")
    first.step()
    assert first.status["phase"] == "Running"

    later = Job(cluster, named("later", "later", mode="Observe"))
    later.body["spec"]["profiling"]["model"] = model
    later.step()
    assert later.status["phase"] == "Pending" and later.plans_written() == []
    assert says in later.condition("Profiled")["message"]


def test_observe_profiles_only_when_the_job_opts_in(cluster: FakeCluster) -> None:
    cluster.pods = pods_of("gpt3", ("node-0", "node-1"))
    job = Job(cluster, named("gpt3", "gpt3", mode="Observe"))
    job.body["spec"]["profiling"]["profileInObserve"] = True
    job.step()
    assert job.status["phase"] == "Profiling"
    assert all(s["profiling"] for s in job.plans_written())
    report_all(cluster, "gpt3")
    job.step()
    assert job.status["phase"] == "Running"
    assert cluster.node_plans == {}  # the sweep's plans are gone; the plan is not applied
    assert all(s["profiling"] for s in job.plans_written())  # never a plan with clocks


def test_observe_with_a_profile_ref_writes_no_node_plan(cluster: FakeCluster) -> None:
    cluster.pods = pods_of("first", ("node-0", "node-1")) + pods_of("gpt3", ("node-2", "node-3"))
    first = Job(cluster, named("first", "first"))
    first.step()
    report_all(cluster, "first")
    first.step()
    kept = copy.deepcopy(cluster.config_maps[(NS, profile_config_map_name("first"))])
    kept["metadata"] = {"name": "kept"}
    cluster.config_maps[(NS, "kept")] = kept
    job = Job(cluster, named("gpt3", "gpt3", mode="Observe"))
    job.body["spec"]["profiling"]["profileRef"] = {"configMapName": "kept"}
    job.step()
    assert job.status["phase"] == "Running" and job.plans_written() == []
    # A job that does not name the model makes no call to find a shared profile.
    assert not [c for c in cluster.calls if c[0] in ("list_config_maps", "get_node")]


# -- profiling that nobody calls in to --------------------------------------------------------


def silent_gpu(assignment: dict[str, Any], frequencies_mhz: list[int]) -> dict[str, Any]:
    """An agent's report of a profiled GPU whose training process never began an iteration
    (the fields the agent's GpuProfilingReport has then)."""
    return {
        "uuid": f"GPU-{assignment['localRank']}",
        "index": assignment["localRank"],
        "stage": assignment["stage"],
        "rank": assignment["rank"],
        "frequencies_mhz": frequencies_mhz,
        "applied_mhz": [None] * len(frequencies_mhz),
        "frequency_index": 0,
        "measured_iterations": 0,
        "dropped_iterations": 0,
        "done": False,
        "rows": [],
        "blocking_power_w": None,
        "blocking_s": 0.0,
    }


def test_stage_without_client_hooks_ends_with_no_training_process_naming_the_pods(
    cluster: FakeCluster,
) -> None:
    cluster.pods = pods_of("gpt3", ("node-0", "node-1"))
    job = Job(cluster, named("gpt3", "gpt3", granularity="Stage"))
    job.body["spec"]["profiling"]["trainingProcessTimeoutSeconds"] = 30
    t0 = 1_800_000_000.0
    job.step(t0)
    assert job.status["phase"] == "Profiling"
    assert (
        "Stage granularity: profiling needs the training loop to call perseus_client"
        in (job.status["message"])
    )
    # node-0's processes call in and finish; node-1's agent sees its plan, nobody calls in.
    for (_, _), plan in cluster.node_plans.items():
        spec = plan["spec"]
        clocks = spec["profiling"]["frequenciesMHz"]
        if spec["node"] == "node-0":
            plan["status"] = {"profiling": profiling_reports(spec)}
        else:
            plan["status"] = {"profiling": [silent_gpu(a, clocks) for a in spec["assignments"]]}

    job.step(t0 + 10)
    assert job.status["phase"] == "Profiling"
    assert (
        "waiting for the training processes of pods gpt3-1 to call in (10 of 30 s)"
        in (job.status["message"])
    )
    job.step(t0 + 30)
    assert job.status["phase"] == "Failed"
    message = job.status["message"]
    assert "within 30 s (profiling.trainingProcessTimeoutSeconds) on pods gpt3-1 " in message
    assert "gpt3-1 (ranks 4, 5, 6, 7 on node node-1)" in message and "gpt3-0" not in message
    assert "spec.profiling.profileRef" in message
    profiled = job.condition("Profiled")
    assert (profiled["status"], profiled["reason"]) == ("False", "NoTrainingProcess")
    assert job.condition("Degraded")["reason"] == "NoTrainingProcess"
    assert ("Warning", "NoTrainingProcess", message) in job.events
    assert cluster.node_plans == {}  # the profiling plans are withdrawn: the agents reset

    # The way out the message names: a stored profile.
    kept = {"metadata": {"name": "kept"}, "data": {"profile.csv": first_profile(cluster)}}
    cluster.config_maps[(NS, "kept")] = kept
    job.body["spec"]["profiling"]["profileRef"] = {"configMapName": "kept"}
    job.body["metadata"]["generation"] = 2
    job.step(t0 + 40)
    assert job.status["phase"] == "Running"


def first_profile(cluster: FakeCluster) -> str:
    other = FakeCluster()
    other.pods = pods_of("p", ("node-8", "node-9"))
    job = Job(other, named("p", "p"))
    job.step()
    report_all(other, "p")
    job.step()
    text: str = other.config_maps[(NS, profile_config_map_name("p"))]["data"]["profile.csv"]
    return text


def test_a_node_whose_agent_never_reports_is_named_after_the_default_wait(
    cluster: FakeCluster,
) -> None:
    cluster.pods = pods_of("gpt3", ("node-0", "node-1"))
    job = Job(cluster, named("gpt3", "gpt3"))  # trainingProcessTimeoutSeconds: 600
    job.step(1000.0)
    job.step(1599.0)
    assert job.status["phase"] == "Profiling"
    job.step(1600.0)
    assert job.status["phase"] == "Failed"
    assert (
        "gpt3-0 (ranks 0, 1, 2, 3 on node node-0: no report from the node agent)"
        in (job.status["message"])
    )


def test_a_long_sweep_is_never_timed_out_but_one_that_stops_moving_is(
    cluster: FakeCluster,
) -> None:
    """Measuring takes as long as the model's iterations do; standing still is bounded."""
    cluster.pods = pods_of("gpt3", ("node-0", "node-1"))
    job = Job(cluster, named("gpt3", "gpt3"))
    job.body["spec"]["profiling"]["trainingProcessTimeoutSeconds"] = 5
    job.step(1000.0)
    reports = {}
    for key, plan in cluster.node_plans.items():
        spec = plan["spec"]
        clocks = spec["profiling"]["frequenciesMHz"]
        reports[key] = [silent_gpu(a, clocks) for a in spec["assignments"]]
        for r in reports[key]:
            r["applied_mhz"][0] = clocks[0]  # the first clock is locked: it called in
    now_s = 1000.0
    for iteration in range(1, 31):  # 30 iterations, 4 s each: 120 s, far past the bound
        now_s += 4
        for key, plan in cluster.node_plans.items():
            for r in reports[key]:
                r["measured_iterations"] = iteration
            plan["status"] = {"profiling": copy.deepcopy(reports[key])}
        job.step(now_s)
        assert job.status["phase"] == "Profiling", job.status["message"]
    assert "0 of 4 pipeline stages measured" in job.status["message"]
    assert "waiting for" not in job.status["message"]

    job.step(now_s + 4.9)  # the training hangs: nothing moves
    assert job.status["phase"] == "Profiling"
    job.step(now_s + 5)
    assert job.status["phase"] == "Failed"
    assert job.condition("Profiled")["reason"] == "ProfilingStalled"
    assert "no progress for 5 s" in job.status["message"]
    assert "pods gpt3-0, gpt3-1 have not finished their sweep" in job.status["message"]
    assert cluster.node_plans == {}


def test_a_waiting_job_reads_its_nodes_once_and_looks_for_a_profile_every_tick(
    cluster: FakeCluster,
) -> None:
    gpu_nodes(cluster, A100, "node-0", "node-1")
    cluster.pods = pods_of("gpt3", ("node-0", "node-1"))
    job = Job(cluster, named("gpt3", "gpt3", mode="Observe"))
    job.body["spec"]["profiling"]["model"] = "gpt3-175b"
    for _ in range(4):
        job.step()
    assert [c for c in cluster.calls if c[0] == "get_node"] == [
        ("get_node", "node-0"),
        ("get_node", "node-1"),
    ]
    lists = [c for c in cluster.calls if c[0] == "list_config_maps"]
    assert lists == [("list_config_maps", f"{MODEL_LABEL}=gpt3-175b")] * 4
