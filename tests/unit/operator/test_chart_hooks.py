"""The chart's Helm hooks: the release test's checks and the uninstall clean-up, on fakes."""

from __future__ import annotations

from typing import Any

from perseus_operator.chart_hooks import (
    CRDS,
    before_uninstall,
    lease_renewed,
    missing_crds,
    release_test,
)
from perseus_operator.cluster.leader_election import LeaseRecord


def crd(name: str, *, established: bool = True, version: str = "v1alpha1") -> dict[str, Any]:
    status = "True" if established else "False"
    return {
        "metadata": {"name": name},
        "spec": {"versions": [{"name": version, "served": True}]},
        "status": {"conditions": [{"type": "Established", "status": status}]},
    }


def test_crds_all_served_and_established() -> None:
    assert missing_crds([crd(n) for n in CRDS]) == []


def test_crd_problems_are_named() -> None:
    jobs, plans, _policies = CRDS
    problems = missing_crds([crd(jobs, established=False), crd(plans, version="v1beta1")])
    assert problems == [
        f"CRD {jobs} is not Established",
        f"CRD {plans} does not serve v1alpha1 (serves ['v1beta1'])",
        "CRD perseuspolicies.perseus.energy is not installed",
    ]


def lease(holder: str, version: str) -> LeaseRecord:
    return LeaseRecord(holder, 15, None, None, 0, version)


def test_a_lease_renewed_between_two_reads_passes() -> None:
    assert lease_renewed(lease("a", "1"), lease("a", "2")) == ""
    assert lease_renewed(lease("a", "1"), lease("b", "2")) == ""  # a takeover is renewal too


def test_a_stale_released_or_missing_lease_fails() -> None:
    assert "was not renewed" in lease_renewed(lease("a", "1"), lease("a", "1"))
    assert "released" in lease_renewed(lease("a", "1"), lease("", "2"))
    assert "has ever held" in lease_renewed(None, None)


class Cluster:
    """Jobs that the (fake) operator finishes ``release_after`` polls after their deletion."""

    def __init__(self, jobs: list[tuple[str, str]], release_after: int | None) -> None:
        self.state = dict.fromkeys(jobs, -1)
        self.policy_names = ["team-a"]
        self.release_after = release_after
        self.deleted: list[str] = []

    def crds(self) -> list[dict[str, Any]]:
        return [crd(n) for n in CRDS]

    def policies(self) -> list[dict[str, Any]]:
        return [{"metadata": {"name": n}} for n in self.policy_names]

    def delete_policy(self, name: str) -> None:
        self.deleted.append(f"policy {name}")
        self.policy_names.remove(name)

    def jobs_left(self) -> list[tuple[str, str]]:
        return list(self.state)

    def jobs(self, namespace: str | None) -> list[dict[str, Any]]:
        for key, polls in list(self.state.items()):
            if polls >= 0:
                self.state[key] = polls + 1
                if self.release_after is not None and polls + 1 > self.release_after:
                    del self.state[key]  # finalizer removed: gone
        return [
            {"metadata": {"namespace": ns, "name": name}}
            for ns, name in self.state
            if namespace in (None, ns)
        ]

    def delete_job(self, namespace: str, name: str) -> None:
        self.deleted.append(f"job {namespace}/{name}")
        self.state[(namespace, name)] = max(self.state[(namespace, name)], 0)


def run(cluster: Cluster, namespaces: list[str], timeout_s: float) -> tuple[bool, list[str]]:
    now = [0.0]
    said: list[str] = []
    ok = before_uninstall(
        cluster,
        namespaces,
        timeout_s=timeout_s,
        say=said.append,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    return ok, said


def test_uninstall_deletes_policies_then_jobs_and_waits_until_they_are_gone() -> None:
    cluster = Cluster([("ml", "a"), ("ml", "b")], release_after=2)
    ok, said = run(cluster, [], timeout_s=60)
    assert ok
    assert cluster.deleted == ["policy team-a", "job ml/a", "job ml/b"]  # each asked once
    assert cluster.jobs_left() == []
    assert said[-1] == "no PerseusJob left: every job's GPUs were reset"


def test_uninstall_only_touches_the_watched_namespaces() -> None:
    cluster = Cluster([("ml", "a"), ("other", "b")], release_after=0)
    ok, _ = run(cluster, ["ml"], timeout_s=60)
    assert ok
    assert cluster.jobs_left() == [("other", "b")]


def test_uninstall_fails_naming_the_jobs_when_no_operator_releases_them() -> None:
    cluster = Cluster([("ml", "a")], release_after=None)
    ok, said = run(cluster, [], timeout_s=5)
    assert not ok
    assert "1 PerseusJob(s) still there after 5 s: ml/a" in said[-1]
    assert "--no-hooks" in said[-1]


def test_release_test_reports_a_lease_nobody_renews() -> None:
    class Still:
        def get(self) -> LeaseRecord:
            return lease("perseus-operator-0", "5")

        def create(self, record: LeaseRecord) -> bool:
            raise AssertionError("the test only reads")

        update = create

    said: list[str] = []
    ok = release_test(
        Cluster([], None), Still(), retry_period_s=0, say=said.append, sleep=lambda s: None
    )
    assert not ok
    assert said[-1] == "FAIL: the leader Lease held by 'perseus-operator-0' was not renewed"
