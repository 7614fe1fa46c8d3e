"""The policy controller's I/O (:mod:`perseus_operator.policies.policy_controller`) on a fake API: a
round that cannot read everything changes nothing, one failed write does not stop the others, an
event is posted once, and a missing CRD turns the policies off quietly."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from perseus_operator.cluster.kube.client import KubeError
from perseus_operator.policies.policy_controller import PolicyController, get_event
from perseus_operator.policies.policy_sync import WorkloadEvent
from support.fake_policy_kube import FakeKube, policy
from support.workload_objects import pytorch_job

Obj = dict[str, Any]


def controller(kube: FakeKube) -> PolicyController:
    return PolicyController(kube, interval_s=60)


def orphan_job(name: str) -> Obj:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "labels": {"perseus.energy/policy": "research"},
            "ownerReferences": [{"uid": f"uid-gone-{name}", "controller": True}],
        },
        "spec": {"workload": {"kind": "PyTorchJob", "name": name}},
    }


def test_a_round_creates_posts_once_and_writes_the_status() -> None:
    kube = FakeKube([policy()])
    kube.workloads["ml"] = [pytorch_job("gpt3", "ml")]
    plan = asyncio.run(controller_round(kube, rounds=2))
    assert plan is not None
    # The second round sees no job yet (the fake stores none): it creates again, but the
    # event with the same message is not posted twice.
    assert kube.writes.count(("event", "PolicyApplied")) == 1
    assert kube.writes.count(("create", "gpt3")) == 2
    assert ("status", "research") in kube.writes


async def controller_round(kube: FakeKube, rounds: int = 1) -> Any:
    c = controller(kube)
    plan = None
    for _ in range(rounds):
        plan = await c.sync()
    return plan


def test_a_round_that_cannot_read_changes_nothing() -> None:
    kube = FakeKube([policy()])
    kube.jobs = [orphan_job("old")]
    kube.fail["list_workloads"] = KubeError("HTTP 500: etcd timeout", 500)
    with pytest.raises(KubeError):
        asyncio.run(controller_round(kube))
    assert kube.writes == []  # the orphan is not deleted on a partial view


def test_a_failed_write_does_not_stop_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube([policy()])
    kube.workloads["ml"] = [pytorch_job("gpt3", "ml")]
    kube.jobs = [orphan_job("old")]
    kube.fail["create_job"] = KubeError("HTTP 403: forbidden", 403)
    with caplog.at_level(logging.WARNING, logger="perseus_operator.policies.selection"):
        asyncio.run(controller_round(kube))
    assert ("delete", "old") in kube.writes
    assert ("status", "research") in kube.writes
    assert "could not create PerseusJob ml/gpt3: HTTP 403: forbidden" in caplog.text


def test_an_event_that_failed_is_posted_again_next_round() -> None:
    kube = FakeKube([policy()])
    kube.workloads["ml"] = [pytorch_job("gpt3", "ml")]
    kube.fail["create_event"] = KubeError("HTTP 500", 500)
    c = controller(kube)
    asyncio.run(c.sync())
    del kube.fail["create_event"]
    asyncio.run(c.sync())
    assert kube.writes.count(("event", "PolicyApplied")) == 1


def test_without_the_crd_policies_are_off(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube(None)
    with caplog.at_level(logging.WARNING, logger="perseus_operator.policies.selection"):
        assert asyncio.run(controller_round(kube, rounds=3)) is None
    assert caplog.text.count("the PerseusPolicy CRD is not installed") == 1
    assert kube.namespaces_listed == 0 and kube.writes == []


def test_without_policies_no_namespace_is_read_and_old_jobs_go() -> None:
    kube = FakeKube([])
    kube.jobs = [orphan_job("old")]
    asyncio.run(controller_round(kube))
    assert kube.namespaces_listed == 0
    assert kube.writes == [("delete", "old")]


def test_run_keeps_going_after_a_failed_round_and_wakes_on_demand() -> None:
    kube = FakeKube([policy()])
    kube.fail["list_workloads"] = KubeError("HTTP 500", 500)
    c = PolicyController(kube, interval_s=3600)

    async def scenario() -> None:
        task = asyncio.create_task(c.run())
        await asyncio.sleep(0.05)
        assert kube.namespaces_listed == 1
        del kube.fail["list_workloads"]
        c.wake()
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert kube.namespaces_listed == 2
    assert ("status", "research") in kube.writes


def test_event_objects() -> None:
    event = WorkloadEvent(
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "name": "gpt3",
            "namespace": "ml",
            "uid": "u1",
        },
        "Warning",
        "ParallelismUnknown",
        "no PerseusJob created",
    )
    body = get_event(event, "2026-11-30T10:00:00Z")
    assert body["metadata"] == {"generateName": "gpt3.", "namespace": "ml"}
    assert body["involvedObject"]["uid"] == "u1"
    assert (body["type"], body["reason"], body["count"]) == ("Warning", "ParallelismUnknown", 1)
    assert body["source"] == {"component": "perseus-operator"}
