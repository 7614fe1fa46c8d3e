"""A power budget's per-GPU power limits on the operator's side: the share each GPU gets (pure),
the job's annotation, and its node plans rewritten with (and without) them by the job's reconcile,
through the same re-target path as the budget's target time."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_operator_lifecycle import Operator, running

from perseus_api.power_budget import PerseusPowerBudgetSpec
from perseus_operator.jobs.power_limits import (
    POWER_LIMITS_ANNOTATION,
    annotation_value,
    limits_changed,
    planned_power_limits_w,
    power_limits_w,
)
from perseus_operator.power.budget_decisions import Assigned, gpu_power_limits, job_gpus_by_node
from support.fake_job_io import FakeCluster, report_iterations
from support.lifecycle_job import pod

NODES = ("node-0", "node-1")


@pytest.fixture
def cluster() -> FakeCluster:
    c = FakeCluster()
    c.pods = [pod(0), pod(1)]
    return c


def spec(enforcement: str = "PlansAndPowerLimits", margin: float = 0.05) -> PerseusPowerBudgetSpec:
    return PerseusPowerBudgetSpec.model_validate(
        {
            "budgetWatts": 10_000,
            "nodeSelector": {"matchLabels": {"rack": "a"}},
            "safetyMarginRatio": margin,
            "enforcement": enforcement,
        }
    )


def node_plan(namespace: str, job: str, node: str, gpus: int) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "name": f"{job}-{node}"},
        "spec": {"node": node, "job": job, "assignments": [{"plan": "p"}] * gpus},
    }


# -- the share of each GPU (pure) ------------------------------------------------------------------


def test_each_gpu_gets_its_jobs_watts_over_its_gpus_plus_the_margin() -> None:
    plans = [
        node_plan("ml", "a", "n1", 4),
        node_plan("ml", "a", "n2", 4),
        node_plan("ml", "b", "n2", 2),
        node_plan("ml", "b", "elsewhere", 2),  # not in the domain
        node_plan("team", "a", "n1", 0),  # no GPU: not a share
    ]
    gpus = job_gpus_by_node({"n1", "n2"}, plans)
    assert gpus == {("ml", "a"): {"n1": 4, "n2": 4}, ("ml", "b"): {"n2": 2}}
    assigned = {("ml", "a"): Assigned(0, 2000.0, 0.03), ("ml", "b"): Assigned(3, 500.0, 0.0)}

    limits = gpu_power_limits(spec(margin=0.05), assigned, gpus)

    assert limits == {
        ("ml", "a"): {"n1": 262.5, "n2": 262.5},  # 2000 / 8 x 1.05
        ("ml", "b"): {"n2": 262.5},  # 500 / 2 x 1.05
    }


def test_no_limits_without_the_backstop_and_none_for_jobs_without_gpus() -> None:
    gpus = {("ml", "a"): {"n1": 4}}
    assigned = {("ml", "a"): Assigned(0, 1000.0, 0.0), ("ml", "gone"): Assigned(0, 1.0, 0.0)}
    assert gpu_power_limits(spec("Plans"), assigned, gpus) == {}
    assert gpu_power_limits(spec(), assigned, gpus) == {("ml", "a"): {"n1": 262.5}}


def test_a_share_is_kept_within_a_node_plans_bounds() -> None:
    gpus = {("ml", "huge"): {"n1": 1}, ("ml", "tiny"): {"n1": 1000}}
    assigned = {("ml", "huge"): Assigned(0, 1e6, 0.0), ("ml", "tiny"): Assigned(0, 10.0, 0.0)}
    limits = gpu_power_limits(spec(margin=0.0), assigned, gpus)
    assert limits == {("ml", "huge"): {"n1": 5000.0}, ("ml", "tiny"): {"n1": 1.0}}


# -- the annotation and the plans ------------------------------------------------------------------


def test_the_annotation_round_trips_and_a_bad_one_means_no_limits() -> None:
    value = annotation_value({"n2": 262.5, "n1": 300.0})
    assert value == '{"n1":300.0,"n2":262.5}'
    assert power_limits_w({POWER_LIMITS_ANNOTATION: value}) == {"n1": 300.0, "n2": 262.5}
    assert annotation_value({}) is None
    for bad in ("", "x", "[1]", '{"n1": "300"}', '{"n1": 0.5}', '{"n1": 9000}', '{"": 300}'):
        assert power_limits_w({POWER_LIMITS_ANNOTATION: bad}) == {}, bad
    assert power_limits_w({POWER_LIMITS_ANNOTATION: '{"n1": 300, "n2": true}'}) == {"n1": 300.0}
    assert power_limits_w(None) == {}


def test_plans_change_only_where_they_carry_other_limits_than_wanted() -> None:
    plans = [
        {
            "spec": {
                "node": "n1",
                "assignments": [{"powerLimitWatts": 300}, {"powerLimitWatts": 300}],
            }
        },
        {"spec": {"node": "n2", "assignments": [{"plan": "p"}]}},
        {"spec": {"node": "n3", "assignments": []}},  # no GPU: nothing to limit
    ]
    assert planned_power_limits_w(plans) == {"n1": 300.0}
    assert not limits_changed({"n1": 300.0, "n3": 300.0, "far": 1.0}, plans)
    assert limits_changed({"n1": 300.0, "n2": 300.0}, plans)  # n2 lacks its limit
    assert limits_changed({}, plans)  # n1 must lose its limit
    assert limits_changed({"n1": 250.0}, plans)


# -- the job's reconcile ---------------------------------------------------------------------------


def limits_in_plans(cluster: FakeCluster) -> dict[str, set[object]]:
    return {
        node: {a.get("powerLimitWatts") for a in cluster.spec(node)["assignments"]}
        for node in NODES
    }


def test_the_annotation_writes_limits_into_every_node_plan_and_its_removal_takes_them_out(
    cluster: FakeCluster,
) -> None:
    op = running(cluster)
    t_min = op.status["frontier"]["tMinSeconds"]
    revision = op.status["revision"]
    assert limits_in_plans(cluster) == {"node-0": {None}, "node-1": {None}}

    annotations = op.body["metadata"].setdefault("annotations", {})
    annotations[POWER_LIMITS_ANNOTATION] = json.dumps({"node-0": 262.5, "node-1": 250.0})
    report_iterations(cluster, {}, t_min)
    op.step()
    assert op.status["revision"] == revision + 1
    assert limits_in_plans(cluster) == {"node-0": {262.5}, "node-1": {250.0}}

    report_iterations(cluster, {}, t_min)
    op.step()
    assert op.status["revision"] == revision + 1  # the same limits: nothing rewritten

    # A restarted operator (no memory of what it wrote) compares with the plans: no rewrite.
    restarted = Operator(cluster, op.body)
    report_iterations(cluster, {}, t_min)
    restarted.step()
    assert restarted.status["revision"] == revision + 1

    # The budget goes while the operator is down: the next one takes the limits out.
    del annotations[POWER_LIMITS_ANNOTATION]
    again = Operator(cluster, op.body)
    report_iterations(cluster, {}, t_min)
    again.step()
    assert again.status["revision"] == revision + 2
    assert limits_in_plans(cluster) == {"node-0": {None}, "node-1": {None}}


def test_a_straggler_rewrite_keeps_the_limits(cluster: FakeCluster) -> None:
    op = running(cluster)
    t_min = op.status["frontier"]["tMinSeconds"]
    op.body["metadata"]["annotations"] = {POWER_LIMITS_ANNOTATION: '{"node-0":300,"node-1":300}'}
    report_iterations(cluster, {}, t_min)
    op.step()
    revision = op.status["revision"]
    for _ in range(2):
        report_iterations(cluster, {1: 1.12}, t_min)
        op.step()
    assert op.status["revision"] > revision  # re-targeted around the straggler
    assert limits_in_plans(cluster) == {"node-0": {300.0}, "node-1": {300.0}}
