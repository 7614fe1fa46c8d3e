"""A PerseusJob's whole life through :func:`perseus_operator.jobs.lifecycle.reconcile`, against an
in-memory cluster: create → profile (agents played by the test) → optimize → plans written →
straggler → re-target → recover → complete; plus the ways a job waits or fails."""

from __future__ import annotations

import asyncio
import copy
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from perseus_api import resources
from perseus_api.node_plan import NodePlan
from perseus_api.profile import parse_profile
from perseus_operator.jobs.job_decisions import (
    POWER_TARGET_ANNOTATION,
    STRAGGLER_STATE_ANNOTATION,
    power_target_s,
)
from perseus_operator.jobs.job_release import (
    RELEASE_PENDING,
    Release,
    ReleaseDecision,
    decide_release,
)
from perseus_operator.jobs.lifecycle import JobMemo, Outcome, reconcile, release
from perseus_operator.jobs.phase_decisions import profile_config_map_name
from perseus_operator.jobs.planner_pool import InlinePlanner
from perseus_operator.jobs.planning import RETARGETED_PLAN, TMIN_PLAN
from perseus_operator.jobs.running_decisions import planned_target_s, rank_samples
from perseus_operator.workloads.ranks import RankPlacement
from support.factories import pipeline_plan_fields
from support.fake_job_io import FakeCluster, profiling_reports, report_iterations
from support.lifecycle_job import GPUS_PER_POD, JOB, NS, STAGES, job_body, pod
from support.malformed_jobs import MALFORMED, Mutation, malformed
from support.operator_harness import cut_profile


class Operator:
    """Runs reconcile like the kopf handlers do: status written back, memo kept."""

    def __init__(self, cluster: FakeCluster, body: dict[str, Any]) -> None:
        self.cluster = cluster
        self.body = body
        cluster.jobs[(NS, body["metadata"]["name"])] = body
        self.memo = JobMemo()
        self.events: list[tuple[str, str]] = []

    def step(self) -> Outcome:
        outcome = asyncio.run(
            reconcile(self.body, self.cluster, InlinePlanner(), self.memo, now_s=time.time())
        )
        self.body["status"] = outcome.status.model_dump(mode="json", by_alias=True)
        if outcome.detector_state is not None:
            annotations = self.body["metadata"].setdefault("annotations", {})
            annotations[STRAGGLER_STATE_ANNOTATION] = outcome.detector_state
        self.events += [(e.reason, e.message) for e in outcome.events]
        return outcome

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.body["status"]
        return status

    def condition(self, kind: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == kind)


@pytest.fixture
def cluster() -> FakeCluster:
    c = FakeCluster()
    c.pods = [pod(0), pod(1)]
    return c


def plan_of_replicas(cluster: FakeCluster) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for node in ("node-0", "node-1"):
        for a in cluster.spec(node)["assignments"]:
            out.setdefault(a["dpRank"], set()).add(a["plan"])
    return out


def test_whole_life_profile_optimize_straggler_recover_complete(cluster: FakeCluster) -> None:
    op = Operator(cluster, job_body())

    # Pending → Profiling: one node plan per node, profiling every GPU at its stage.
    op.step()
    assert op.status["phase"] == "Profiling"
    assert op.status["nodes"] == ["node-0", "node-1"]
    specs = {node: cluster.spec(node) for node in ("node-0", "node-1")}
    for spec in specs.values():
        assert spec["profiling"]["iterationsPerFrequency"] == 2
        assert spec["profiling"]["frequenciesMHz"][0] == 2100
        assert len(spec["assignments"]) == GPUS_PER_POD
    # Ranks 0..3 on node-0: tp-dp-pp order with dp=2: (dp, pp) = (0,0) (1,0) (0,1) (1,1).
    assert [(a["localRank"], a["dpRank"], a["stage"]) for a in specs["node-0"]["assignments"]] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 0, 1),
        (3, 1, 1),
    ]

    # Half the agents finished: still profiling.
    cluster.report("node-0", profiling=profiling_reports(specs["node-0"]))
    op.step()
    assert op.status["phase"] == "Profiling"
    assert "2 of 4 pipeline stages measured" in op.status["message"]

    # All done: profile stored in a ConfigMap owned by the job, planned, plans written.
    cluster.report("node-1", profiling=profiling_reports(specs["node-1"]))
    op.step()
    assert op.status["phase"] == "Running"
    stored = cluster.config_maps[(NS, profile_config_map_name(JOB))]
    assert stored["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert parse_profile(stored["data"]["profile.csv"], "stored").num_stages == STAGES
    frontier = op.status["frontier"]
    assert 0 < frontier["tMinSeconds"] < frontier["tStarSeconds"] <= frontier["tMaxSeconds"]
    plan = op.status["plan"]
    assert plan["targetIterationSeconds"] == pytest.approx(frontier["tMinSeconds"])
    assert 0.0 < plan["expectedSavingsRatio"] < 0.3
    assert plan_of_replicas(cluster) == {0: {TMIN_PLAN}, 1: {TMIN_PLAN}}
    assert cluster.spec("node-0").get("profiling") is None
    assert cluster.spec("node-0")["revision"] == plan["revision"] == op.status["revision"]
    assert op.condition("Profiled")["status"] == op.condition("Optimized")["status"] == "True"

    # Agents apply it and report iteration times at T_min: applied, no straggler.
    t_min = frontier["tMinSeconds"]
    report_iterations(cluster, {}, t_min)
    op.step()
    assert op.condition("PlanApplied")["status"] == "True"
    assert op.condition("StragglerDetected")["status"] == "False"

    # Replica 1 slows to 1.2 x: detected after 2 reports (persistenceReports), and replica 0
    # is re-targeted to a slower, cheaper plan; the straggler keeps T_min.
    revision = op.status["revision"]
    report_iterations(cluster, {1: 1.2}, t_min)
    op.step()
    op.step()  # the same report seen again is no new evidence
    assert op.status["stragglers"] == [] and op.status["revision"] == revision
    report_iterations(cluster, {1: 1.2}, t_min)
    op.step()
    [straggler] = op.status["stragglers"]
    assert straggler["dataParallelRank"] == 1 and straggler["node"] in ("node-0", "node-1")
    assert straggler["slowdown"] == pytest.approx(1.2, rel=1e-3)  # vs. the healthy replica
    assert op.condition("StragglerDetected")["status"] == "True"
    assert op.status["revision"] == revision + 1
    assert plan_of_replicas(cluster) == {0: {RETARGETED_PLAN}, 1: {TMIN_PLAN}}
    retargeted = cluster.spec("node-0")["plans"][RETARGETED_PLAN]
    assert t_min < retargeted["instructionEstimate"]["iterationTimeSeconds"] <= 1.2 * t_min * 1.01
    assert op.status["plan"]["expectedSavingsRatio"] > plan["expectedSavingsRatio"]
    detected = [m for reason, m in op.events if reason == "StragglerDetected"]
    assert detected == [
        f"data-parallel replica 1 on node {straggler['node']} is {straggler['slowdown']:.3f}x "
        "slower"
    ]

    # Steady: no rewrite while the straggler stays put, however long: the re-targeted replica
    # now runs at T', as planned, which is not slow, and the straggler stays 1.2x slower.
    writes = cluster.writes
    for _ in range(5):
        report_iterations(cluster, {1: 1.2}, t_min)
        op.step()
    assert cluster.writes == writes
    assert [s["slowdown"] for s in op.status["stragglers"]] == [pytest.approx(1.2, rel=1e-3)]

    # Recovery after 2 reports: everyone back to T_min.
    report_iterations(cluster, {}, t_min)
    op.step()
    report_iterations(cluster, {}, t_min)
    op.step()
    assert op.status["stragglers"] == []
    assert plan_of_replicas(cluster) == {0: {TMIN_PLAN}, 1: {TMIN_PLAN}}
    assert any(reason == "StragglerRecovered" for reason, _ in op.events)

    # The workload finishes: plans deleted (agents reset), job Completed.
    for p in cluster.pods:
        p["status"]["phase"] = "Succeeded"
    op.step()
    assert op.status["phase"] == "Completed"
    assert cluster.node_plans == {}
    phases = [m for reason, m in op.events if reason == "Phase"]
    assert phases == [
        "Pending → Profiling",
        "Profiling → Running",
        "Running → Completed",
    ]


def running(cluster: FakeCluster, **policy: Any) -> Operator:
    """A job whose stored profile lets it skip profiling, reconciled once."""
    op = Operator(cluster, job_body(**policy))
    op.step()
    specs = {node: cluster.spec(node) for node in ("node-0", "node-1")}
    for node, spec in specs.items():
        cluster.report(node, profiling=profiling_reports(spec))
    op.step()
    assert op.status["phase"] == "Running", op.status
    return op


def test_stage_granularity_plans_one_clock_per_gpu(cluster: FakeCluster) -> None:
    running(cluster, granularity="Stage")
    spec = cluster.spec("node-1")
    assert spec["granularity"] == "Stage"
    assert spec["plans"][TMIN_PLAN]["granularity"] == "Stage"


def test_spec_change_replans_without_profiling_again(cluster: FakeCluster) -> None:
    op = running(cluster)
    revision = op.status["revision"]
    op.body["spec"]["policy"]["maxSlowdown"] = 0.05
    op.body["metadata"]["generation"] = 2
    op.step()
    assert op.status["phase"] == "Running"
    assert op.status["observedGeneration"] == 2
    assert op.status["revision"] == revision + 1
    assert cluster.spec("node-0")["plans"][TMIN_PLAN]["objective"] == "MaxSlowdown"
    assert cluster.spec("node-0").get("profiling") is None  # the stored profile was reused


def test_a_restarted_operator_resumes_from_the_cluster(cluster: FakeCluster) -> None:
    op = running(cluster)
    revision = op.status["revision"]
    restarted = Operator(cluster, op.body)  # new memo: no frontier, no detector
    report_iterations(cluster, {}, op.status["frontier"]["tMinSeconds"])
    restarted.step()
    assert restarted.status["phase"] == "Running"
    assert restarted.status["revision"] == revision  # nothing rewritten
    assert restarted.memo.frontier is not None


def test_an_operator_restarted_while_profiling_loses_no_measurement(
    cluster: FakeCluster,
) -> None:
    op = Operator(cluster, job_body())
    op.step()
    assert op.status["phase"] == "Profiling"
    revision = op.status["revision"]
    cluster.report("node-0", profiling=profiling_reports(cluster.spec("node-0")))

    restarted = Operator(cluster, copy.deepcopy(op.body))  # nothing in memory
    restarted.step()
    assert restarted.status["phase"] == "Profiling"
    assert restarted.status["revision"] == revision  # the profiling plans were not rewritten
    cluster.report("node-1", profiling=profiling_reports(cluster.spec("node-1")))
    restarted.step()
    assert restarted.status["phase"] == "Running"
    assert (NS, profile_config_map_name(JOB)) in cluster.config_maps


def test_a_restarted_operator_keeps_the_straggler_and_its_target(cluster: FakeCluster) -> None:
    op = running(cluster)
    t_min = op.status["frontier"]["tMinSeconds"]
    for _ in range(2):
        # Agents not upgraded yet (snake_case reports); they are by the restart below.
        report_iterations(cluster, {1: 1.2}, t_min, legacy=True)
        op.step()
    assert plan_of_replicas(cluster) == {0: {RETARGETED_PLAN}, 1: {TMIN_PLAN}}
    revision = op.status["revision"]

    restarted = Operator(cluster, copy.deepcopy(op.body))
    report_iterations(cluster, {1: 1.2}, t_min)
    restarted.step()
    assert restarted.status["revision"] == revision  # no flap back to T_min and again
    assert [s["dataParallelRank"] for s in restarted.status["stragglers"]] == [1]
    assert restarted.memo.retarget_s == pytest.approx(1.2 * t_min, rel=0.01)
    # It recovers as it would have without the restart.
    for _ in range(2):
        report_iterations(cluster, {}, t_min)
        restarted.step()
    assert plan_of_replicas(cluster) == {0: {TMIN_PLAN}, 1: {TMIN_PLAN}}


def test_the_target_is_the_stragglers_slowdown_in_planned_time(cluster: FakeCluster) -> None:
    """Measured iterations run 30% longer than planned (all-reduce, data loading): the healthy
    replica is re-targeted to 1.2 x T_min planned, not to the straggler's wall-clock time,
    which as a frontier time would make it slower than the straggler; likewise after a
    restart."""
    op = running(cluster)
    t_min = op.status["frontier"]["tMinSeconds"]
    overhead = 1.3
    for _ in range(2):
        report_iterations(cluster, {1: 1.2}, overhead * t_min)
        op.step()
    assert plan_of_replicas(cluster) == {0: {RETARGETED_PLAN}, 1: {TMIN_PLAN}}
    assert op.memo.retarget_s == pytest.approx(1.2 * t_min, rel=1e-3)
    retargeted = cluster.spec("node-0")["plans"][RETARGETED_PLAN]
    assert retargeted["instructionEstimate"]["iterationTimeSeconds"] <= 1.2 * t_min * 1.01
    assert [s["slowdown"] for s in op.status["stragglers"]] == [pytest.approx(1.2, rel=1e-3)]

    restarted = Operator(cluster, copy.deepcopy(op.body))
    report_iterations(cluster, {1: 1.2}, overhead * t_min)
    restarted.step()
    assert restarted.memo.retarget_s == pytest.approx(1.2 * t_min, rel=1e-3)
    assert restarted.status["plan"]["targetIterationSeconds"] == pytest.approx(
        op.status["plan"]["targetIterationSeconds"]
    )


def test_planned_target_falls_back_to_the_measured_one() -> None:
    assert planned_target_s(None, 1.0, 2.0) is None
    assert planned_target_s(3.0, None, 2.0) == 3.0
    assert planned_target_s(3.0, 1.5, None) == 3.0
    assert planned_target_s(3.0, 1.5, 1.0) == pytest.approx(2.0)


def test_stale_telemetry_is_degraded_not_a_straggler(cluster: FakeCluster) -> None:
    op = running(cluster)
    t_min = op.status["frontier"]["tMinSeconds"]
    for _ in range(3):
        report_iterations(cluster, {1: 1.3}, t_min, age_s=3600)
        op.step()
    assert op.status["stragglers"] == []
    degraded = op.condition("Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "StaleTelemetry"


@pytest.mark.parametrize(
    ("mutate", "phase", "message"),
    [
        (lambda c, b: c.pods.pop(), "Pending", "found 1 of 2 pods"),
        (lambda c, b: c.pods[1]["spec"].update(nodeName=None), "Pending", "not scheduled"),
        (
            lambda c, b: b["spec"]["parallelism"].update(dataParallel=1),
            "Failed",
            "parallelism asks for",
        ),
        (
            lambda c, b: b["spec"].update(workload={"kind": "PyTorchJob", "name": "nope"}),
            "Pending",
            "PyTorchJob ml/nope does not exist",
        ),
        (
            lambda c, b: b["spec"]["parallelism"].update(pipelineStages=1),
            "Failed",
            "invalid spec: parallelism.pipelineStages",
        ),
        (
            lambda c, b: b["spec"]["profiling"].update(profileRef={"configMapName": "missing"}),
            "Failed",
            "ConfigMap missing does not exist",
        ),
    ],
)
def test_jobs_that_cannot_proceed_say_why(
    cluster: FakeCluster, mutate: Any, phase: str, message: str
) -> None:
    body = job_body()
    mutate(cluster, body)
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == phase
    assert message in op.status["message"], op.status["message"]
    assert cluster.node_plans == {}


@pytest.mark.parametrize(
    ("mutation", "phase", "message"),
    [pytest.param(m, phase, text, id=case) for case, m, phase, text in MALFORMED],
)
def test_malformed_jobs_get_a_precise_message(
    cluster: FakeCluster, mutation: Mutation, phase: str, message: str
) -> None:
    body = job_body()
    body["spec"] = malformed(body["spec"], mutation)
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == phase
    assert message in op.status["message"], op.status["message"]
    assert cluster.node_plans == {}
    if phase == "Failed":
        assert op.condition("Degraded")["message"] == op.status["message"]
        assert [r for r, _ in op.events] == [op.condition("Degraded")["reason"], "Phase"]


def test_a_profile_that_does_not_fit_fails_the_job_with_the_reason(cluster: FakeCluster) -> None:
    cluster.config_maps[(NS, "stored")] = {"data": {"profile.csv": cut_profile(2)}}
    body = job_body()
    body["spec"]["profiling"]["profileRef"] = {"configMapName": "stored"}
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == "Failed"
    assert "has 2 stages but the pipeline has 4" in op.status["message"]
    assert op.condition("Degraded")["reason"] == "PlanningFailed"


def test_profile_ref_skips_profiling(cluster: FakeCluster) -> None:
    cluster.config_maps[(NS, "stored")] = {"data": {"profile.csv": cut_profile(STAGES)}}
    body = job_body()
    body["spec"]["profiling"]["profileRef"] = {"configMapName": "stored"}
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == "Running"
    assert op.status["frontier"]["profileConfigMap"] == "stored"
    assert plan_of_replicas(cluster) == {0: {TMIN_PLAN}, 1: {TMIN_PLAN}}


def test_failed_workload_fails_the_job_and_releases_the_gpus(cluster: FakeCluster) -> None:
    op = running(cluster)
    cluster.pods[0]["status"]["phase"] = "Failed"
    op.step()
    assert op.status["phase"] == "Failed"
    assert cluster.node_plans == {}
    assert "failed" in op.status["message"]


def pytorch_pod(replica: str, index: int) -> dict[str, Any]:
    """A pod as the Kubeflow training operator creates it for a PyTorchJob."""
    rank = 0 if replica == "master" else index + 1
    return {
        "metadata": {
            "name": f"gpt3-pretrain-{replica}-{index}",
            "namespace": NS,
            "labels": {
                "training.kubeflow.org/job-name": "gpt3-pretrain",
                "training.kubeflow.org/replica-type": replica,
                "training.kubeflow.org/replica-index": str(index),
            },
        },
        "spec": {
            "nodeName": f"node-{rank}",
            "containers": [
                {
                    "name": "pytorch",
                    "env": [{"name": "PET_NODE_RANK", "value": str(rank)}],
                    "resources": {"limits": {"nvidia.com/gpu": str(GPUS_PER_POD)}},
                }
            ],
        },
        "status": {"phase": "Running"},
    }


def test_a_pytorchjob_is_resolved_by_the_training_operators_labels() -> None:
    cluster = FakeCluster()
    cluster.workloads[(NS, "gpt3-pretrain")] = {"kind": "PyTorchJob"}
    cluster.pods = [pytorch_pod("worker", 0), pytorch_pod("master", 0)]
    body = job_body()
    body["spec"]["workload"] = {"kind": "PyTorchJob", "name": "gpt3-pretrain"}
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == "Profiling"
    master = cluster.spec("node-0")["assignments"]
    assert [(a["rank"], a["pod"]) for a in master] == [
        (r, "gpt3-pretrain-master-0") for r in range(GPUS_PER_POD)
    ]
    worker = cluster.spec("node-1")["assignments"]
    assert [a["rank"] for a in worker] == list(range(GPUS_PER_POD, 2 * GPUS_PER_POD))


@pytest.mark.parametrize(
    ("condition", "phase", "message"),
    [
        ({"type": "Succeeded", "status": "True"}, "Completed", "the workload finished"),
        (
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"},
            "Failed",
            "PyTorchJob gpt3-pretrain failed (BackoffLimitExceeded)",
        ),
    ],
    ids=["succeeded", "failed"],
)
def test_a_pytorchjob_that_ended_ends_the_job_even_with_its_pods_gone(
    condition: dict[str, str], phase: str, message: str
) -> None:
    """The training operator deletes the pods of a finished job (``cleanPodPolicy``): its own
    status says how it ended, and the plans go (the agents reset the GPUs)."""
    cluster = FakeCluster()
    pytorchjob: dict[str, Any] = {"kind": "PyTorchJob", "metadata": {"name": "gpt3-pretrain"}}
    cluster.workloads[(NS, "gpt3-pretrain")] = pytorchjob
    cluster.pods = [pytorch_pod("worker", 0), pytorch_pod("master", 0)]
    body = job_body()
    body["spec"]["workload"] = {"kind": "PyTorchJob", "name": "gpt3-pretrain"}
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == "Profiling" and cluster.node_plans

    cluster.pods = []
    op.step()  # pods gone, nothing said yet: it waits, plans kept
    assert op.status["phase"] == "Profiling" and cluster.node_plans
    pytorchjob["status"] = {"conditions": [{"type": "Created", "status": "True"}, condition]}
    op.step()
    assert op.status["phase"] == phase
    assert message in op.status["message"]
    assert cluster.node_plans == {}


def test_a_failed_pod_of_a_pytorchjob_waits_for_the_controllers_word() -> None:
    """Under restartPolicy OnFailure/ExitCode the training operator runs a failed pod again:
    the job keeps its plans (Degraded PodFailed) until the pod is back, and fails only when
    the PyTorchJob itself says Failed."""
    cluster = FakeCluster()
    pytorchjob: dict[str, Any] = {"kind": "PyTorchJob", "metadata": {"name": "gpt3-pretrain"}}
    cluster.workloads[(NS, "gpt3-pretrain")] = pytorchjob
    cluster.pods = [pytorch_pod("worker", 0), pytorch_pod("master", 0)]
    body = job_body()
    body["spec"]["workload"] = {"kind": "PyTorchJob", "name": "gpt3-pretrain"}
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == "Profiling" and cluster.node_plans
    plans = dict(cluster.node_plans)

    cluster.pods[0]["status"] = {"phase": "Failed", "reason": "Error"}
    op.step()
    assert op.status["phase"] == "Profiling"
    assert cluster.node_plans == plans
    degraded = op.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "PodFailed")
    assert "gpt3-pretrain-worker-0" in degraded["message"]
    assert "waiting for the PyTorchJob" in degraded["message"]

    cluster.pods[0] = pytorch_pod("worker", 0)  # the controller's replacement
    op.step()
    assert op.status["phase"] == "Profiling"
    assert (op.condition("Degraded")["status"], op.condition("Degraded")["reason"]) == (
        "False",
        "PodsRunning",
    )

    cluster.pods[0]["status"] = {"phase": "Failed", "reason": "Error"}
    op.step()
    pytorchjob["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
    }
    op.step()
    assert op.status["phase"] == "Failed"
    assert "PyTorchJob gpt3-pretrain failed (BackoffLimitExceeded)" in op.status["message"]
    assert cluster.node_plans == {}


def test_the_operators_default_policy_fills_the_fields_a_job_leaves_unset(
    cluster: FakeCluster,
) -> None:
    defaults = {"mode": "Observe", "granularity": "Stage"}
    unset = Operator(cluster, job_body())  # the job sets only blockingPowerWatts
    step_with(unset, defaults)
    assert (unset.status["mode"], unset.status["granularity"]) == ("Observe", "Stage")

    own = Operator(cluster, job_body(mode="Intrinsic"))  # the job's own field wins
    step_with(own, defaults)
    assert (own.status["mode"], own.status["granularity"]) == ("Intrinsic", "Stage")


def step_with(op: Operator, defaults: dict[str, Any]) -> None:
    outcome = asyncio.run(
        reconcile(op.body, op.cluster, InlinePlanner(), op.memo, default_policy=defaults)
    )
    op.body["status"] = outcome.status.model_dump(mode="json", by_alias=True)


def test_rank_samples_compare_ranks_at_the_pace_of_the_fastest_plan() -> None:
    """A replica re-targeted to ``T'`` reports ``T'``: at its plan's pace, not slow. A report
    measured under an older revision than the one written is no evidence yet."""

    def node_plan(node: str, revision: int, expected_s: float, reports: list[Any]) -> Any:
        estimate = {"iteration_time_s": expected_s, "energy_j": 1.0, "savings_ratio": 0.1}
        rank = 0 if node == "node-0" else 1
        return {
            "spec": {
                "node": node,
                "revision": revision,
                "granularity": "Instruction",
                "plans": {"p": {"instruction_estimate": estimate, "stage_estimate": estimate}},
                "assignments": [{"rank": rank, "plan": "p", "stage": 0, "dp_rank": rank}],
            },
            "status": {"ranks": reports},
        }

    def report(rank: int, mean_s: float, revision: int | None) -> dict[str, Any]:
        # An older agent's snake_case report: the operator reads those too.
        out = {
            "rank": rank,
            "iterations": 9,
            "last_iteration_s": mean_s,
            "mean_iteration_s": mean_s,
        }
        return out if revision is None else {**out, "revision": revision}

    ranks = [
        RankPlacement(rank=r, dp_rank=r, pp_rank=0, tp_rank=0, pod=f"p{r}", node=f"node-{r}",
                      local_rank=0)
        for r in (0, 1)
    ]  # fmt: skip
    plans = [
        node_plan("node-0", 3, 1.2, [report(0, 1.2, 3)]),  # re-targeted to T' = 1.2 T_min
        node_plan("node-1", 3, 1.0, [report(1, 1.2, 3)]),  # the straggler, on the T_min plan
    ]
    samples = {s.rank: s.mean_iteration_s for s in rank_samples(plans, ranks, now_s=0.0)}
    assert samples == {0: pytest.approx(1.0), 1: pytest.approx(1.2)}

    plans[0]["status"]["ranks"] = [report(0, 1.0, 2)]  # still the mean of revision 2
    assert [s.rank for s in rank_samples(plans, ranks, now_s=0.0)] == [1]
    plans[0]["status"]["ranks"] = [report(0, 1.2, None)]  # an agent that does not say
    assert len(rank_samples(plans, ranks, now_s=0.0)) == 2


def test_release_empties_every_node_plan_then_deletes_it_once_its_agent_confirms(
    cluster: FakeCluster,
) -> None:
    owner = {"apiVersion": resources.API_VERSION, "kind": "PerseusJob", "name": JOB, "uid": "u"}
    for node in ("node-0", "node-1"):
        plan = NodePlan.model_validate(
            {
                "node": node,
                "namespace": NS,
                "job": JOB,
                "revision": 4,
                "granularity": "Instruction",
                "plans": {"p": pipeline_plan_fields()},
                "assignments": [{"gpu_index": 0, "plan": "p", "stage": 0, "rank": 0}],
            }
        )
        asyncio.run(cluster.put_node_plan(resources.node_plan_object(plan), owner))

    # Listed objects carry the server's metadata: the emptied ones must not.
    first = asyncio.run(release(NS, JOB, cluster, owner))
    assert (first.done, first.waiting_for) == (False, ("node-0", "node-1"))
    for node in ("node-0", "node-1"):
        spec = cluster.spec(node)
        assert (spec["revision"], spec["assignments"], spec["plans"]) == (5, [], {})
    assert asyncio.run(release(NS, JOB, cluster, owner)).waiting_for == ("node-0", "node-1")

    cluster.report("node-0", observedRevision=5)  # its agent reset the GPUs
    second = asyncio.run(release(NS, JOB, cluster, owner))
    assert (second.done, second.waiting_for) == (False, ("node-1",))
    assert set(cluster.node_plans) == {(NS, resources.node_plan_name(JOB, "node-1"))}
    cluster.report("node-1", observedRevision=5)
    assert asyncio.run(release(NS, JOB, cluster, owner)).done
    assert cluster.node_plans == {}


# -- deletion: kopf retries instead of sleeping in the handler (issue 18, item 13) -------------


def test_release_decision_retries_until_done_then_forces_at_the_deadline() -> None:
    waiting = Release(done=False, waiting_for=("node-0", "node-1"))
    assert decide_release(Release(done=True), 0.0, 60.0, 1.0) == ReleaseDecision(None)
    assert decide_release(Release(done=True), 999.0, 60.0, 1.0).finish

    early = decide_release(waiting, 12.4, 60.0, 1.0)
    assert not early.finish and not early.force
    assert early.retry_in_s == 1.0
    assert early.message.startswith(RELEASE_PENDING)
    assert "node-0, node-1" in early.message and "(12 of 60 s)" in early.message

    near = decide_release(waiting, 59.75, 60.0, 1.0)  # the last retry lands on the deadline
    assert near.retry_in_s == pytest.approx(0.25)

    late = decide_release(waiting, 60.0, 60.0, 1.0)
    assert late.finish and late.force
    assert late.message == (
        "agents of node-0, node-1 did not confirm the reset within 60 s; deleting their plans "
        "anyway"
    )


class _Metrics:
    def __init__(self) -> None:
        self.forgotten: list[tuple[str, str]] = []

    def forget_job(self, namespace: str, name: str) -> None:
        self.forgotten.append((namespace, name))


def _deleting(cluster: FakeCluster, jobs: int) -> tuple[Any, list[Any]]:
    """An operator memo over ``cluster`` and the bodies of ``jobs`` deleted PerseusJobs, each
    with a node plan on one node."""
    import kopf

    from perseus_operator import handlers

    owner = {"apiVersion": resources.API_VERSION, "kind": "PerseusJob", "name": JOB, "uid": "u"}
    bodies = []
    for j in range(jobs):
        name = f"job-{j}"
        plan = NodePlan.model_validate(
            {
                "node": f"node-{j}",
                "namespace": NS,
                "job": name,
                "revision": 4,
                "granularity": "Instruction",
                "plans": {"p": pipeline_plan_fields()},
                "assignments": [{"gpu_index": 0, "plan": "p", "stage": 0, "rank": 0}],
            }
        )
        asyncio.run(cluster.put_node_plan(resources.node_plan_object(plan), owner))
        raw = job_body()
        raw["metadata"] = {
            **raw["metadata"],
            "name": name,
            "uid": f"uid-{j}",
            "deletionTimestamp": datetime.now(tz=UTC).isoformat(),
        }
        bodies.append(kopf.Body(raw))
    state = handlers._Operator(
        kube=cluster,  # type: ignore[arg-type]
        planner=None,  # type: ignore[arg-type]
        metrics=_Metrics(),  # type: ignore[arg-type]
        policies=None,  # type: ignore[arg-type]
    )
    return {"perseus": state}, bodies


def _indexes(cluster: FakeCluster) -> dict[str, Any]:
    """The handlers' index arguments as kopf has them once the watch events are in."""
    from perseus_operator.cluster.cluster_index import node_plan_entries

    plans: dict[Any, list[Any]] = {}
    for obj in cluster.node_plans.values():
        for key, value in node_plan_entries(obj).items():
            plans.setdefault(key, []).append(value)
    return {"perseus_pods": {}, "perseus_node_plans": plans, "perseus_workloads": {}}


def _plan_key(job: str, node: str) -> tuple[str, str]:
    return (NS, resources.node_plan_name(job, node))


def test_deleting_many_jobs_never_sleeps_in_the_handler(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf

    from perseus_operator import handlers

    async def no_sleep(*_: object) -> None:
        raise AssertionError("the delete handler slept instead of asking kopf to retry")

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    memo, bodies = _deleting(cluster, jobs=10)

    async def delete_all(runtime_s: float) -> list[BaseException | None]:
        calls = [
            handlers.deleted(
                body=b, memo=memo, runtime=timedelta(seconds=runtime_s), **_indexes(cluster)
            )
            for b in bodies
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    # Every job's plans are emptied at once; each handler returns a retry at once.
    results = asyncio.run(delete_all(0.0))
    assert all(isinstance(r, kopf.TemporaryError) for r in results), results
    first = results[0]
    assert isinstance(first, kopf.TemporaryError)
    assert first.delay == handlers.RELEASE_POLL_S
    assert str(first).startswith(RELEASE_PENDING) and "node-0" in str(first)
    for j in range(10):
        assert cluster.node_plans[_plan_key(f"job-{j}", f"node-{j}")]["spec"]["assignments"] == []
    assert memo["perseus"].metrics.forgotten == []  # the finalizer stays

    # The agents confirm: the next retry deletes the plans and lets the jobs go.
    for j in range(10):
        cluster.node_plans[_plan_key(f"job-{j}", f"node-{j}")]["status"] = {"observedRevision": 5}
    assert asyncio.run(delete_all(1.0)) == [None] * 10
    assert cluster.node_plans == {}
    assert sorted(memo["perseus"].metrics.forgotten) == sorted((NS, f"job-{j}") for j in range(10))


def test_a_deletion_past_the_release_timeout_warns_and_deletes_the_plans(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf

    from perseus_operator import handlers

    warnings: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, **kw: warnings.append(kw))
    memo, (body,) = _deleting(cluster, jobs=1)
    timeout_s = handlers.CONFIG.release_timeout_s
    with pytest.raises(kopf.TemporaryError):
        asyncio.run(
            handlers.deleted(
                body=body, memo=memo, runtime=timedelta(seconds=1), **_indexes(cluster)
            )
        )
    # Counted across retries (kopf's runtime), although the deletion timestamp is recent.
    runtime = timedelta(seconds=timeout_s)
    deleted = handlers.deleted(body=body, memo=memo, runtime=runtime, **_indexes(cluster))
    assert asyncio.run(deleted) is None
    assert cluster.node_plans == {}
    assert warnings == [
        {
            "reason": "ReleaseTimeout",
            "message": f"agents of node-0 did not confirm the reset within {timeout_s:g} s; "
            "deleting their plans anyway",
        }
    ]
    assert memo["perseus"].metrics.forgotten == [(NS, "job-0")]


def test_kopfs_error_log_of_a_release_retry_is_demoted_to_info() -> None:
    import logging

    from perseus_operator import handlers

    def record(message: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)

    retry = record(f"Handler 'deleted' failed temporarily: {RELEASE_PENDING}: waiting for ...")
    assert handlers.RELEASE_RETRY_FILTER.filter(retry)
    assert (retry.levelno, retry.levelname) == (logging.INFO, "INFO")
    other = record("Handler 'changed' failed temporarily: boom")
    assert handlers.RELEASE_RETRY_FILTER.filter(other)
    assert other.levelno == logging.ERROR
    assert handlers.RELEASE_RETRY_FILTER in logging.getLogger("kopf.objects").filters


# -- two jobs on the same pods: the older keeps the GPUs (issue 18, item 12) --------------------


def _job_named(name: str, created: str) -> dict[str, Any]:
    body = job_body()
    body["metadata"] = {**body["metadata"], "name": name, "uid": f"uid-{name}"}
    body["metadata"]["creationTimestamp"] = created
    return body


def _plans_of(cluster: FakeCluster, job: str) -> list[dict[str, Any]]:
    return [p for p in cluster.node_plans.values() if p["spec"]["job"] == job]


def _profiled(cluster: FakeCluster, job: str) -> None:
    for plan in _plans_of(cluster, job):
        plan["status"] = {"profiling": profiling_reports(plan["spec"])}


def test_the_newer_of_two_jobs_on_the_same_pods_writes_no_node_plans(
    cluster: FakeCluster,
) -> None:
    older = Operator(cluster, _job_named(JOB, "2026-12-01T10:00:00Z"))
    newer = Operator(cluster, _job_named("gpt3-copy", "2026-12-01T11:00:00Z"))
    older.step()
    _profiled(cluster, JOB)
    older.step()
    assert older.status["phase"] == "Running"

    newer.step()
    assert newer.status["phase"] == "Pending"
    degraded = newer.condition("Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "GpuConflict")
    assert f"older PerseusJob {NS}/{JOB}, created 2026-12-01T10:00:00Z" in degraded["message"]
    assert "node-0/gpt3-0#0" in degraded["message"] and "and 4 more" in degraded["message"]
    assert newer.status["message"] == degraded["message"]
    assert _plans_of(cluster, "gpt3-copy") == []
    assert ("GpuConflict", degraded["message"]) in newer.events
    newer.step()  # still waiting: no second event
    assert [r for r, _ in newer.events].count("GpuConflict") == 1

    older.step()  # the older job is not disturbed
    assert older.status["phase"] == "Running"
    assert all(c["reason"] != "GpuConflict" for c in older.status["conditions"])

    # The older job goes (its plans are released): the newer one takes over the GPUs.
    for key in [k for k, p in cluster.node_plans.items() if p["spec"]["job"] == JOB]:
        del cluster.node_plans[key]
    del cluster.jobs[(NS, JOB)]
    newer.step()
    assert newer.status["phase"] == "Profiling"
    assert newer.condition("Degraded")["reason"] == "GpuConflictResolved"
    assert len(_plans_of(cluster, "gpt3-copy")) == 2


def test_a_newer_job_that_wrote_plans_first_withdraws_them(cluster: FakeCluster) -> None:
    """Created together, the newer one may plan before the older has: it withdraws then."""
    older = Operator(cluster, _job_named("b-older", "2026-12-01T10:00:00Z"))
    newer = Operator(cluster, _job_named("a-newer", "2026-12-01T10:00:01Z"))
    newer.step()
    assert len(_plans_of(cluster, "a-newer")) == 2
    older.step()  # older: the newer one's plans do not stop it
    assert older.status["phase"] == "Profiling"
    assert len(_plans_of(cluster, "b-older")) == 2
    newer.step()
    assert newer.status["phase"] == "Pending"
    assert newer.condition("Degraded")["reason"] == "GpuConflict"
    assert _plans_of(cluster, "a-newer") == []
    assert len(_plans_of(cluster, "b-older")) == 2


def test_jobs_on_other_gpus_do_not_conflict(cluster: FakeCluster) -> None:
    cluster.node_plans[(NS, "other-node-9")] = {
        "metadata": {
            "name": "other-node-9",
            "namespace": NS,
            "labels": {resources.JOB_LABEL: "other"},
        },
        "spec": {
            "job": "other",
            "namespace": NS,
            "node": "node-9",
            "assignments": [{"gpu_index": 0, "plan": "p", "stage": 0, "rank": 0}],
        },
    }
    cluster.jobs[(NS, "other")] = _job_named("other", "2020-01-01T00:00:00Z")
    op = Operator(cluster, _job_named(JOB, "2026-12-01T10:00:00Z"))
    op.step()
    assert op.status["phase"] == "Profiling"


def test_a_job_that_fails_for_its_own_reason_says_so_whoever_holds_its_gpus(
    cluster: FakeCluster,
) -> None:
    older = Operator(cluster, _job_named(JOB, "2026-12-01T10:00:00Z"))
    older.step()
    body = _job_named("no-profile", "2026-12-01T11:00:00Z")
    body["spec"]["profiling"]["profileRef"] = {"configMapName": "missing"}
    newer = Operator(cluster, body)
    newer.step()
    assert newer.status["phase"] == "Failed"
    assert "profileRef: ConfigMap missing does not exist" in newer.status["message"]


def test_measured_blocking_power_beyond_the_planners_limit_fails_the_job_with_the_limit(
    cluster: FakeCluster,
) -> None:
    """A profile whose measured blocking power the integer arithmetic cannot hold (issue 18,
    item 7): the job is Failed with the limit, the operator does not crash."""
    data = {"profile.csv": cut_profile(STAGES), "blockingPowerWatts": "1e+12"}
    cluster.config_maps[(NS, "stored")] = {"data": data}
    body = job_body()
    del body["spec"]["policy"]["blockingPowerWatts"]
    body["spec"]["profiling"]["profileRef"] = {"configMapName": "stored"}
    op = Operator(cluster, body)
    op.step()
    assert op.status["phase"] == "Failed"
    assert "above the planner's limit of 7.04e+07 J" in op.status["message"]
    assert op.condition("Degraded")["reason"] == "PlanningFailed"
    assert cluster.node_plans == {}


def test_a_power_target_rewrites_every_replicas_plan_and_its_removal_gives_t_min_back(
    cluster: FakeCluster,
) -> None:
    """The budget controller's annotation re-targets the job as a straggler's T' does (every
    healthy replica, from the stored frontier, no re-solve); removing it writes T_min again;
    with a straggler the slower of the two targets wins."""
    op = running(cluster)
    t_min = op.status["frontier"]["tMinSeconds"]
    revision = op.status["revision"]
    frontier = op.memo.frontier
    annotations = op.body["metadata"].setdefault("annotations", {})
    annotations[POWER_TARGET_ANNOTATION] = f"{1.05 * t_min:.9g}"
    report_iterations(cluster, {}, t_min)
    op.step()
    assert op.memo.frontier is frontier  # not solved again
    assert op.status["revision"] == revision + 1
    assert plan_of_replicas(cluster) == {0: {RETARGETED_PLAN}, 1: {RETARGETED_PLAN}}
    retargeted = cluster.spec("node-0")["plans"][RETARGETED_PLAN]
    assert t_min < retargeted["instructionEstimate"]["iterationTimeSeconds"] <= 1.05 * t_min * 1.01
    assert op.status["plan"]["targetIterationSeconds"] == pytest.approx(1.05 * t_min, rel=1e-3)

    report_iterations(cluster, {}, 1.05 * t_min)
    op.step()
    assert op.status["revision"] == revision + 1  # the same target: nothing rewritten

    # A straggler slower than the power target: its T' wins for the healthy replica.
    for _ in range(2):
        report_iterations(cluster, {1: 1.12}, 1.05 * t_min)
        op.step()
    assert plan_of_replicas(cluster) == {0: {RETARGETED_PLAN}, 1: {TMIN_PLAN}}
    assert op.memo.retarget_s is not None and op.memo.retarget_s > 1.1 * t_min
    assert op.status["plan"]["targetIterationSeconds"] == pytest.approx(
        op.memo.retarget_s, rel=1e-3
    )

    del annotations[POWER_TARGET_ANNOTATION]
    for _ in range(3):
        report_iterations(cluster, {}, t_min)
        op.step()
    assert op.memo.power_target_s is None
    assert plan_of_replicas(cluster) == {0: {TMIN_PLAN}, 1: {TMIN_PLAN}}


@pytest.mark.parametrize("value", ["", "x", "-1", "0", "inf", "nan"])
def test_a_power_target_that_is_not_a_positive_time_means_none(value: str) -> None:
    assert power_target_s({POWER_TARGET_ANNOTATION: value}) is None
    assert power_target_s({POWER_TARGET_ANNOTATION: "2.5"}) == 2.5
    assert power_target_s(None) is None
