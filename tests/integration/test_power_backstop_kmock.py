"""The power budget controller's backstop against kmock's Kubernetes API: with ``enforcement:
PlansAndPowerLimits`` every job of the domain gets the power limit of each of its GPUs, by node,
in its annotation (its share of the job's allocated watts, plus the margin); switching to
``Plans`` or deleting the budget removes it. The set-up (two running jobs with the real frontiers
of the bundled GPT-3 and Bloom A100 profiles, on two nodes of one rack) is
``test_power_budget_kmock``'s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_power_budget_kmock import (
    BUDGET_RESOURCES,
    GPUS_PER_JOB,
    GROUP,
    JOBS,
    NAMESPACE,
    VERSION,
    Cluster,
    SolveFrontier,
    _t_min_w,
)

from perseus_api.power_budget import BUDGET_PLURAL
from perseus_operator.jobs.power_limits import power_limits_w
from perseus_planner.frontier import Frontier
from support.kmock_server import KmockServer

MARGIN = 0.05
Frontiers = dict[tuple[str, str], Frontier]


@pytest.fixture(scope="module")
def frontiers(solved_frontier: SolveFrontier) -> Frontiers:
    return {(NAMESPACE, job): solved_frontier(m, "a100_sxm", 12) for job, (m, _) in JOBS.items()}


@pytest.fixture
def cluster(tmp_path: Path, frontiers: Frontiers) -> Iterator[Cluster]:
    with KmockServer(BUDGET_RESOURCES) as server:
        c = Cluster(server.write_kubeconfig(tmp_path / "kubeconfig"), frontiers)
        try:
            c.create()
            yield c
        finally:
            c.close()


def limits(cluster: Cluster) -> dict[str, dict[str, float]]:
    out = {}
    for job in JOBS:
        obj = cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "perseusjobs", job
        )
        out[job] = power_limits_w(obj["metadata"].get("annotations") or {})
    return out


def enforce(cluster: Cluster, enforcement: str) -> None:
    patch: dict[str, Any] = {"spec": {"enforcement": enforcement}}
    cluster.custom.patch_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, "rack-a", patch)


def test_the_backstop_limits_every_gpu_to_its_share_and_goes_with_the_mode_or_the_budget(
    cluster: Cluster, frontiers: Frontiers
) -> None:
    t_min_w = {job: _t_min_w(frontiers[(NAMESPACE, job)]) for job in JOBS}
    cluster.report(t_min_w)
    cluster.budget("rack-a", 0.95 * sum(t_min_w.values()))
    cluster.sync()
    assert limits(cluster) == {job: {} for job in JOBS}  # Plans: no limits

    enforce(cluster, "PlansAndPowerLimits")
    cluster.report(t_min_w)
    cluster.sync()
    allocated = {j["name"]: j for j in cluster.status("rack-a")["jobs"]}
    expected = {}
    for job, (_, node) in JOBS.items():
        assert allocated[job]["gpus"] == GPUS_PER_JOB
        share_w = allocated[job]["allocatedWatts"] / GPUS_PER_JOB * (1 + MARGIN)
        expected[job] = share_w
        assert set(limits(cluster)[job]) == {node}
        assert abs(limits(cluster)[job][node] - share_w) <= 0.1
    # The limits add up to about the budget: the plans aim below it, the limits at it.
    total_w = sum(GPUS_PER_JOB * w for w in expected.values())
    assert total_w <= 0.95 * sum(t_min_w.values()) * 1.001

    enforce(cluster, "Plans")
    cluster.report(t_min_w)
    cluster.sync()
    assert limits(cluster) == {job: {} for job in JOBS}

    enforce(cluster, "PlansAndPowerLimits")
    cluster.report(t_min_w)
    cluster.sync()
    assert all(limits(cluster)[job] for job in JOBS)
    cluster.custom.delete_cluster_custom_object(GROUP, VERSION, BUDGET_PLURAL, "rack-a")
    cluster.sync()
    assert limits(cluster) == {job: {} for job in JOBS}
