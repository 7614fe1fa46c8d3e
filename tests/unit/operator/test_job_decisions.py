"""The pure decisions of a reconcile step, without a cluster: what each returns for what was
read, and that the status passed in is never changed."""

from __future__ import annotations

import json
from typing import Any

from perseus_api.job import PerseusJobSpec, Stragglers
from perseus_api.job_status import ConditionType, PerseusJobStatus, Phase
from perseus_operator.jobs.job_decisions import (
    ForgetDetector,
    JobRef,
    ReleaseNodePlans,
    WorkloadView,
    decide_generation,
    decide_workload,
)
from perseus_operator.jobs.job_release import DeleteNodePlan, EmptyNodePlan, decide_release_step
from perseus_operator.jobs.stragglers import RankSample, StragglerDetector
from support.lifecycle_job import NS, job_body, pod

SPEC = PerseusJobSpec.model_validate(job_body()["spec"])
REF = JobRef(NS, "gpt3", "uid-1", 2, {})


def degraded(status: PerseusJobStatus) -> tuple[str, str] | None:
    found = [c for c in status.conditions if c.type == ConditionType.DEGRADED]
    return (found[0].status, found[0].reason) if found else None


def test_every_pod_placed_goes_on_with_the_ranks_and_leaves_the_input_alone() -> None:
    before = PerseusJobStatus(phase=Phase.RUNNING)
    workload = decide_workload(SPEC, before, REF, WorkloadView(None, [pod(0), pod(1)]))
    assert workload.decision.go_on
    assert workload.ranks is not None and len(workload.ranks) == 8
    assert workload.decision.status.nodes == ["node-0", "node-1"]
    assert workload.decision.actions == ()
    assert before.nodes == []


def test_a_missing_pod_waits_and_its_return_clears_the_condition() -> None:
    pending = decide_workload(SPEC, PerseusJobStatus(), REF, WorkloadView(None, [pod(0)]))
    assert not pending.decision.go_on and pending.ranks is None
    assert degraded(pending.decision.status) == ("False", "WaitingForPods")

    running = PerseusJobStatus(phase=Phase.RUNNING)
    gone = decide_workload(SPEC, running, REF, WorkloadView(None, [pod(0)]))
    assert degraded(gone.decision.status) == ("True", "WaitingForPods")
    assert gone.decision.actions == ()  # the plans stay until the pods come back
    back = decide_workload(SPEC, gone.decision.status, REF, WorkloadView(None, [pod(0), pod(1)]))
    assert back.decision.go_on
    assert degraded(back.decision.status) == ("False", "PodsRunning")


def test_a_failed_pod_of_plain_pods_fails_the_job_and_releases_the_gpus() -> None:
    view = WorkloadView(None, [pod(0), pod(1, phase="Failed")])
    workload = decide_workload(SPEC, PerseusJobStatus(phase=Phase.RUNNING), REF, view)
    assert workload.decision.status.phase == Phase.FAILED
    assert workload.decision.actions == (ReleaseNodePlans(),)
    assert [e.reason for e in workload.decision.events] == ["WorkloadFailed"]


def test_a_new_generation_plans_again_and_forgets_the_detector() -> None:
    status = PerseusJobStatus(phase=Phase.RUNNING, observedGeneration=1, message="old")
    decision = decide_generation(SPEC, status, 2)
    assert decision.go_on
    assert decision.status.phase == Phase.PENDING and decision.status.message == ""
    assert decision.actions == (ForgetDetector(),)
    assert [e.reason for e in decision.events] == ["SpecChanged"]
    assert status.phase == Phase.RUNNING

    done = PerseusJobStatus(phase=Phase.COMPLETED, observedGeneration=1)
    ended = decide_generation(SPEC, done, 2)
    assert not ended.go_on and ended.actions == () and ended.status.phase == Phase.COMPLETED


def node_plan(node: str, revision: int, assigned: bool, observed: int | None) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "metadata": {"name": f"gpt3-{node}", "namespace": NS, "resourceVersion": "7"},
        "spec": {"node": node, "revision": revision, "assignments": [{"rank": 0}] * assigned},
    }
    if observed is not None:
        plan["status"] = {"observedRevision": observed}
    return plan


def test_a_release_step_empties_then_deletes_what_the_agents_confirmed() -> None:
    step = decide_release_step(
        [
            node_plan("a", 3, assigned=True, observed=3),
            node_plan("b", 4, assigned=False, observed=4),
            node_plan("c", 5, assigned=False, observed=4),
        ]
    )
    emptied, deleted = step.writes
    assert isinstance(emptied, EmptyNodePlan)
    assert emptied.body["spec"]["revision"] == 4 and emptied.body["spec"]["assignments"] == []
    assert "resourceVersion" not in emptied.body["metadata"]
    assert deleted == DeleteNodePlan(NS, "gpt3-b")
    assert not step.outcome.done and step.outcome.waiting_for == ("a", "c")


def test_the_detector_state_is_saved_only_when_what_decides_changed() -> None:
    settings = Stragglers(persistenceReports=2, warmupIterations=0)
    detector = StragglerDetector(settings)
    saved = detector.state_to_save(None)
    assert saved is not None and json.loads(saved)["replicas"] == {}
    assert detector.state_to_save(saved) is None
    samples = [
        RankSample(
            rank=dp,
            dp_rank=dp,
            pp_rank=0,
            node="n",
            iterations=5,
            mean_iteration_s=1.0,
            reported_at_s=100.0,
        )
        for dp in range(2)
    ]
    detector.observe(samples, 100.0)
    changed = detector.state_to_save(saved)
    assert changed is not None  # the replicas' streaks are new
    resumed = StragglerDetector.from_saved(settings, changed)
    assert resumed is not None and resumed.state_to_save(changed) is None
    assert StragglerDetector.from_saved(settings, "not json") is None
    assert StragglerDetector.from_saved(settings, '{"version": 99}') is None


def test_ranks_are_resolved_once_per_pod_version(monkeypatch: Any) -> None:
    """Every reconcile of a running job sees the same pods: resolved again only when a pod
    changes (its resourceVersion), or when they carry no version to tell."""
    from perseus_operator.jobs import job_decisions

    calls: list[int] = []
    real = job_decisions.resolve_ranks

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(job_decisions, "resolve_ranks", counting)

    def versioned(index: int, version: str) -> dict[str, Any]:
        p = pod(index)
        p["metadata"] = {**p["metadata"], "uid": f"u-{index}", "resourceVersion": version}
        return p

    def ranks(pods: list[dict[str, Any]]) -> Any:
        return decide_workload(SPEC, PerseusJobStatus(), REF, WorkloadView(None, pods)).ranks

    first = ranks([versioned(0, "7"), versioned(1, "7")])
    assert ranks([versioned(0, "7"), versioned(1, "7")]) == first and len(calls) == 1
    moved = versioned(1, "8")
    moved["spec"] = {**moved["spec"], "nodeName": "node-9"}
    assert [r.node for r in ranks([versioned(0, "7"), moved])] != [r.node for r in first]
    assert len(calls) == 2
    ranks([pod(0), pod(1)])
    ranks([pod(0), pod(1)])
    assert len(calls) == 4
