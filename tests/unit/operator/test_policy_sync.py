"""Rounds of the cluster-wide policies (:mod:`perseus_operator.policies.policy_sync`): jobs created,
updated and deleted as workloads, policies and users' own jobs come and go; policy statuses."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from perseus_api.job_status import PerseusJob
from perseus_api.policy import MANAGED_BY_POLICY_LABEL, OPT_OUT_ANNOTATION
from perseus_operator.policies.policy_sync import (
    SPEC_HASH_ANNOTATION,
    ClusterView,
    SyncPlan,
    get_listing,
    get_sync_plan,
    merge_patch,
    parse_policies,
)
from support.workload_objects import NAMESPACES, job_pod, jobset, pytorch_job

Obj = dict[str, Any]
NOW, LATER = "2026-11-30T10:00:00Z", "2026-11-30T10:05:00Z"


def namespace(name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": dict(NAMESPACES[name])},
    }


def policy(name: str = "research", generation: int = 1, **spec: Any) -> Obj:
    fields = {
        "namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}},
        "workloads": [{"kind": "PyTorchJob"}, {"kind": "JobSet"}],
        "policy": {"mode": "Observe"},
    } | spec
    return {
        "apiVersion": "perseus.energy/v1alpha1",
        "kind": "PerseusPolicy",
        "metadata": {"name": name, "generation": generation, "uid": f"uid-policy-{name}"},
        "spec": fields,
    }


class FakeCluster:
    """Objects a round reads, and a round's plan carried out on them as the API server would
    (it fills in defaults the policy left unset)."""

    def __init__(self, *objects: Obj, finalizers: bool = False) -> None:
        # With finalizers a deleted job stays, terminating, until finish_deletions() (the
        # operator's finalizer resetting the GPUs in between).
        self.finalizers = finalizers
        self.policies: list[Obj] = []
        self.namespaces = [namespace(n) for n in NAMESPACES]
        self.workloads: list[Obj] = []
        self.pods: list[Obj] = []
        self.jobs: list[Obj] = []
        for obj in objects:
            self.add(obj)

    def add(self, obj: Obj) -> None:
        kind = obj["kind"]
        group = {
            "PerseusPolicy": self.policies,
            "Pod": self.pods,
            "PerseusJob": self.jobs,
        }.get(kind, self.workloads)
        group.append(obj)

    def remove(self, kind: str, name: str) -> None:
        for group in (self.policies, self.workloads, self.pods, self.jobs):
            group[:] = [o for o in group if (o["kind"], o["metadata"]["name"]) != (kind, name)]

    def view(self) -> ClusterView:
        return ClusterView(
            copy.deepcopy(self.policies),
            copy.deepcopy(self.namespaces),
            copy.deepcopy(self.workloads),
            copy.deepcopy(self.pods),
            copy.deepcopy(self.jobs),
        )

    def round(self, now: str = NOW) -> SyncPlan:
        plan = get_sync_plan(self.view(), now)
        for body in plan.creates:
            stored = copy.deepcopy(body)
            stored["spec"]["policy"].setdefault("granularity", "Instruction")  # a CRD default
            stored["metadata"]["uid"] = f"uid-pj-{body['metadata']['name']}"
            self.jobs.append(stored)
        for update in plan.updates:
            job = self.job(update.name)
            _merge(job, update.patch)
        for deletion in plan.deletes:
            if self.finalizers:
                self.job(deletion.name)["metadata"]["deletionTimestamp"] = now
            else:
                self.remove("PerseusJob", deletion.name)
        for name, status in plan.statuses.items():
            next(p for p in self.policies if p["metadata"]["name"] == name)["status"] = status
        return plan

    def finish_deletions(self) -> None:
        self.jobs = [j for j in self.jobs if "deletionTimestamp" not in j["metadata"]]

    def job(self, name: str) -> Obj:
        return next(j for j in self.jobs if j["metadata"]["name"] == name)

    def status(self, policy_name: str) -> Obj:
        found = next(p for p in self.policies if p["metadata"]["name"] == policy_name)
        status: Obj = found["status"]
        return status


def _merge(target: Obj, patch: Obj) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def events(plan: SyncPlan) -> list[tuple[str, str, str]]:
    return [(e.involved["name"], e.type, e.reason) for e in plan.events]


def cluster_with_two_workloads() -> FakeCluster:
    return FakeCluster(
        policy(),
        pytorch_job("gpt3", "ml"),
        jobset("bloom", "ml-prod"),
        pytorch_job("web-llm", "web"),  # a namespace no policy selects
        pytorch_job("private", "ml", annotations={OPT_OUT_ANNOTATION: "true"}),
    )


# -- creation --------------------------------------------------------------------------------------


def test_a_policy_picks_up_the_workloads_of_opted_in_namespaces_only() -> None:
    cluster = cluster_with_two_workloads()
    plan = cluster.round()
    assert sorted(j["metadata"]["name"] for j in plan.creates) == ["bloom", "gpt3"]
    assert (plan.updates, plan.deletes) == ((), ())
    gpt3 = cluster.job("gpt3")
    PerseusJob.model_validate(gpt3)  # a valid PerseusJob
    assert gpt3["metadata"]["namespace"] == "ml"
    assert gpt3["metadata"]["labels"] == {MANAGED_BY_POLICY_LABEL: "research"}
    assert gpt3["metadata"]["ownerReferences"][0]["uid"] == "uid-pytorchjob-gpt3"
    assert gpt3["spec"]["parallelism"]["dataParallel"] == 8  # 4 pods x 8 GPUs / 4 stages
    assert gpt3["spec"]["policy"]["mode"] == "Observe"
    assert SPEC_HASH_ANNOTATION in gpt3["metadata"]["annotations"]
    assert sorted(events(plan)) == [
        ("bloom", "Normal", "PolicyApplied"),
        ("gpt3", "Normal", "PolicyApplied"),
    ]
    assert "created PerseusJob gpt3: PerseusPolicy research manages this PyTorchJob" in next(
        e.message for e in plan.events if e.involved["name"] == "gpt3"
    )
    status = cluster.status("research")
    assert (status["matchedWorkloads"], status["managedJobs"]) == (2, 2)
    assert status["observedGeneration"] == 1
    assert "expectedSavingsRatio" not in status  # no plan yet
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Accepted"]["status"] == "True"
    assert conditions["Overlapping"]["status"] == "False"
    assert conditions["Accepted"]["lastTransitionTime"] == NOW


def test_a_round_with_nothing_new_changes_nothing() -> None:
    """The server's defaults in the stored jobs are no change: the hash is of what was asked."""
    cluster = cluster_with_two_workloads()
    cluster.round()
    again = cluster.round(LATER)
    assert (again.creates, again.updates, again.deletes, again.statuses) == ((), (), (), {})
    assert cluster.status("research")["conditions"][0]["lastTransitionTime"] == NOW


def test_labelled_pods_get_a_job_owned_by_their_controller() -> None:
    cluster = FakeCluster(
        policy(workloads=[{"kind": "Pods", "labelSelector": {"matchLabels": {"app": "mistral"}}}]),
        job_pod("mistral", 0, app="mistral"),
        job_pod("mistral", 1, app="mistral"),
        job_pod("other", 0, app="other"),
    )
    plan = cluster.round()
    (job,) = plan.creates
    assert job["spec"]["workload"]["kind"] == "Pods"
    assert job["spec"]["workload"]["podSelector"]["matchLabels"]["app"] == "mistral"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "Job"
    assert job["spec"]["parallelism"] == {
        "pipelineStages": 2,
        "dataParallel": 8,
        "tensorParallel": 1,
        "microbatches": 8,
        "schedule": "1F1B",
    }
    (event,) = plan.events
    assert (event.involved["kind"], event.involved["name"]) == ("Job", "mistral")


# -- what a workload or a user says ----------------------------------------------------------------


def test_a_deleted_workload_loses_its_job() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    cluster.remove("PyTorchJob", "gpt3")
    plan = cluster.round()
    assert [(d.name, d.reason) for d in plan.deletes] == [("gpt3", "its workload is gone")]
    assert [j["metadata"]["name"] for j in cluster.jobs] == ["bloom"]
    assert cluster.status("research")["managedJobs"] == 1


def test_opting_out_later_deletes_the_job() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    workload = next(w for w in cluster.workloads if w["metadata"]["name"] == "gpt3")
    workload["metadata"]["annotations"][OPT_OUT_ANNOTATION] = "True "
    plan = cluster.round()
    assert [(d.name, d.reason) for d in plan.deletes] == [("gpt3", "it opted out")]
    assert events(plan) == [("gpt3", "Normal", "PolicyReleased")]


def test_a_users_own_job_takes_over() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    mine = {
        "apiVersion": "perseus.energy/v1alpha1",
        "kind": "PerseusJob",
        "metadata": {"name": "gpt3-mine", "namespace": "ml"},
        "spec": {
            "workload": {"kind": "PyTorchJob", "name": "gpt3"},
            "parallelism": {"pipelineStages": 4, "dataParallel": 8, "microbatches": 8},
        },
    }
    cluster.add(mine)
    plan = cluster.round()
    assert [(d.name, d.reason) for d in plan.deletes] == [
        ("gpt3", "the user's PerseusJob gpt3-mine manages it")
    ]
    assert ("gpt3", "Normal", "UserJobWins") in events(plan)
    assert cluster.job("gpt3-mine") == mine  # never touched
    assert cluster.status("research")["matchedWorkloads"] == 1


def test_a_name_taken_by_a_users_job_is_reported_not_overwritten() -> None:
    cluster = cluster_with_two_workloads()
    cluster.add(
        {
            "apiVersion": "perseus.energy/v1alpha1",
            "kind": "PerseusJob",
            "metadata": {"name": "gpt3", "namespace": "ml"},
            "spec": {"workload": {"kind": "PyTorchJob", "name": "another"}},
        }
    )
    plan = cluster.round()
    assert [j["metadata"]["name"] for j in plan.creates] == ["bloom"]
    assert ("gpt3", "Warning", "NameTaken") in events(plan)


def test_unreadable_parallelism_is_a_warning_and_an_existing_job_is_kept() -> None:
    cluster = FakeCluster(policy(), pytorch_job("gpt3", "ml", annotations={}))
    workload = cluster.workloads[0]
    del workload["metadata"]["annotations"]["perseus.energy/pipeline-stages"]
    plan = cluster.round()
    assert plan.creates == ()
    (event,) = plan.events
    assert (event.type, event.reason) == ("Warning", "ParallelismUnknown")
    assert "no PerseusJob created" in event.message
    assert "perseus.energy/pipeline-stages" in event.message
    status = cluster.status("research")
    assert (status["matchedWorkloads"], status["managedJobs"]) == (1, 0)
    assert "1 without a readable parallelism" in status["message"]

    workload["metadata"]["annotations"]["perseus.energy/pipeline-stages"] = "4"
    assert len(cluster.round().creates) == 1
    del workload["metadata"]["annotations"]["perseus.energy/pipeline-stages"]
    plan = cluster.round()
    assert (plan.creates, plan.updates, plan.deletes) == ((), (), ())
    assert "kept PerseusJob gpt3 as it is" in plan.events[0].message
    assert cluster.status("research")["managedJobs"] == 1


# -- policies changing -----------------------------------------------------------------------------


def test_a_changed_policy_updates_its_jobs_removing_what_it_no_longer_sets() -> None:
    cluster = FakeCluster(policy(policy={"mode": "Observe", "maxSlowdown": 0.05}))
    cluster.add(pytorch_job("gpt3", "ml"))
    cluster.round()
    old_hash = cluster.job("gpt3")["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    cluster.policies[0]["spec"]["policy"] = {"mode": "StragglerAware"}
    cluster.policies[0]["metadata"]["generation"] = 2
    plan = cluster.round(LATER)
    (update,) = plan.updates
    # What the policy no longer sets is removed; the API server fills in its defaults again.
    assert update.patch["spec"]["policy"] == {
        "mode": "StragglerAware",
        "maxSlowdown": None,
        "granularity": None,
    }
    job = cluster.job("gpt3")
    assert job["spec"]["policy"] == {"mode": "StragglerAware"}
    assert job["metadata"]["annotations"][SPEC_HASH_ANNOTATION] != old_hash
    assert events(plan) == [("gpt3", "Normal", "PolicyApplied")]
    assert cluster.status("research")["observedGeneration"] == 2


def test_the_most_specific_policy_wins_and_the_loser_says_so() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    cluster.add(
        policy(
            "llm-team",
            workloads=[{"kind": "PyTorchJob", "labelSelector": {"matchLabels": {"team": "llm"}}}],
            policy={"mode": "Intrinsic"},
        )
    )
    plan = cluster.round(LATER)
    (update,) = plan.updates
    assert update.name == "gpt3"
    assert update.patch["metadata"]["labels"] == {MANAGED_BY_POLICY_LABEL: "llm-team"}
    (event,) = [e for e in plan.events if e.involved["name"] == "gpt3"]
    assert event.reason == "PolicyChanged"
    assert "also selected by research" in event.message
    research, team = cluster.status("research"), cluster.status("llm-team")
    assert (research["matchedWorkloads"], team["matchedWorkloads"]) == (1, 1)
    overlapping = {c["type"]: c for c in research["conditions"]}["Overlapping"]
    assert overlapping["status"] == "True"
    assert overlapping["lastTransitionTime"] == LATER
    assert "PyTorchJob ml/gpt3 (llm-team)" in overlapping["message"]
    assert {c["type"]: c for c in team["conditions"]}["Overlapping"]["status"] == "False"
    # A round later nothing changes, and the choice is said on the workload again (the
    # controller posts an event once per object, reason and message).
    again = cluster.round(LATER)
    assert (again.updates, again.statuses) == ((), {})
    (event,) = [e for e in again.events if e.involved["name"] == "gpt3"]
    assert event.reason == "PoliciesOverlap"
    assert event.message.startswith("PerseusPolicy llm-team manages this PyTorchJob")
    assert "also selected by research" in event.message


def test_a_deleted_policy_or_unselected_namespace_takes_its_jobs_along() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    cluster.namespaces = [n for n in cluster.namespaces if n["metadata"]["name"] != "ml-prod"]
    cluster.namespaces.append(
        {"kind": "Namespace", "metadata": {"name": "ml-prod", "labels": {"team": "serving"}}}
    )
    plan = cluster.round()
    assert [(d.name, d.reason) for d in plan.deletes] == [
        ("bloom", "no PerseusPolicy selects its workload any more")
    ]
    cluster.remove("PerseusPolicy", "research")
    plan = cluster.round()
    assert [d.name for d in plan.deletes] == ["gpt3"]
    assert cluster.jobs == []


def test_a_terminating_job_is_deleted_once_and_never_patched() -> None:
    cluster = cluster_with_two_workloads()
    cluster.finalizers = True
    cluster.round()
    cluster.remove("PerseusPolicy", "research")
    first = cluster.round()
    assert sorted(d.name for d in first.deletes) == ["bloom", "gpt3"]
    # While the finalizers run, later rounds neither delete again nor say so again.
    for _ in range(3):
        again = cluster.round()
        assert (again.deletes, again.updates, again.creates, again.events) == ((), (), (), ())
    cluster.finish_deletions()
    assert cluster.round().deletes == ()


def test_a_terminating_job_is_replaced_only_once_it_is_gone() -> None:
    cluster = cluster_with_two_workloads()
    cluster.finalizers = True
    cluster.round()
    cluster.job("gpt3")["metadata"]["deletionTimestamp"] = NOW  # e.g. kubectl delete pj gpt3
    cluster.policies[0]["spec"]["policy"] = {"mode": "Intrinsic"}  # and the policy changed
    plan = cluster.round()
    assert [u.name for u in plan.updates] == ["bloom"]  # the terminating one is not patched
    assert plan.creates == () and plan.deletes == ()
    cluster.finish_deletions()
    plan = cluster.round()
    assert [c["metadata"]["name"] for c in plan.creates] == ["gpt3"]
    assert cluster.job("gpt3")["spec"]["policy"]["mode"] == "Intrinsic"


def test_an_invalid_policy_is_reported_and_its_jobs_are_left_alone() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    cluster.policies[0]["spec"]["workloads"] = [{"kind": "Pods"}]  # no labelSelector
    plan = cluster.round(LATER)
    assert (plan.creates, plan.updates, plan.deletes) == ((), (), ())
    status = cluster.status("research")
    accepted = {c["type"]: c for c in status["conditions"]}["Accepted"]
    assert (accepted["status"], accepted["reason"]) == ("False", "InvalidSpec")
    assert "workloads.0: Value error, kind Pods needs labelSelector" in accepted["message"]
    assert accepted["lastTransitionTime"] == LATER
    assert len(cluster.jobs) == 2


def test_expected_savings_are_weighted_by_gpus() -> None:
    cluster = cluster_with_two_workloads()
    cluster.round()
    cluster.job("gpt3")["status"] = {"plan": {"expectedSavingsRatio": 0.10}}  # 32 GPUs
    cluster.job("bloom")["status"] = {"plan": {"expectedSavingsRatio": 0.04}}  # 16 GPUs
    cluster.round()
    assert cluster.status("research")["expectedSavingsRatio"] == pytest.approx(0.08)


# -- helpers ---------------------------------------------------------------------------------------


def test_listing_names_the_kinds_selected_per_namespace() -> None:
    valid, invalid = parse_policies(
        [
            policy(),
            policy(
                "prod-pods",
                namespaceSelector={"matchLabels": {"tier": "prod"}},
                workloads=[{"kind": "Pods", "labelSelector": {"matchLabels": {"app": "x"}}}],
            ),
            policy("broken", workloads=[]),
        ]
    )
    assert set(valid) == {"research", "prod-pods"}
    assert invalid["broken"].startswith("PerseusPolicy broken: invalid spec: workloads:")
    listing = get_listing(valid, [namespace(n) for n in NAMESPACES])
    assert {ns: sorted(k.value for k in kinds) for ns, kinds in listing.items()} == {
        "ml": ["JobSet", "PyTorchJob"],
        "ml-prod": ["JobSet", "Pods", "PyTorchJob"],
    }


def test_merge_patch_removes_what_the_new_object_lacks() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1, 2]}
    new = {"b": {"c": 5}, "e": [3], "f": {"g": 1}}
    assert merge_patch(old, new) == {"a": None, "b": {"c": 5, "d": None}, "e": [3], "f": {"g": 1}}
