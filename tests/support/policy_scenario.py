"""A cluster-wide PerseusPolicy at work, against any Kubernetes API (kmock or a real
kube-apiserver) with the operator running: one namespace opted in by label and one not; the
policy picks up the two workloads of the first (a PyTorchJob and a JobSet), ignores the one
outside it and the one that opts out, creates their PerseusJobs, reports in its status, and
cleans up when a workload and then the policy are deleted."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from perseus_api import resources
from perseus_api.policy import MANAGED_BY_POLICY_LABEL, OPT_OUT_ANNOTATION, POLICY_PLURAL
from perseus_operator.cluster.kube.client import WORKLOAD_RESOURCES
from support.workload_objects import jobset, pytorch_job

WaitFor = Callable[..., Any]
GROUP, VERSION = resources.GROUP, resources.VERSION
OPTED_IN, OUTSIDE = "ml-policy", "web-policy"
POLICY = "research-observe"


def policy_body(name: str = POLICY, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PerseusPolicy",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"perseus.energy/enabled": "true"}},
            "workloads": [{"kind": "PyTorchJob"}, {"kind": "JobSet"}],
            "policy": {"mode": "Observe"},
        }
        | spec,
    }


def _created(obj: dict[str, Any], namespace: str) -> dict[str, Any]:
    """The object as a client sends it: no uid (the API server gives one)."""
    body = copy.deepcopy(obj)
    body["metadata"].pop("uid", None)
    body["metadata"]["namespace"] = namespace
    return body


def create_workload(custom: Any, obj: dict[str, Any], namespace: str) -> None:
    kind = next(k for k in WORKLOAD_RESOURCES if k.value == obj["kind"])
    group, version, plural = WORKLOAD_RESOURCES[kind]
    custom.create_namespaced_custom_object(
        group, version, namespace, plural, _created(obj, namespace)
    )


def delete_workload(custom: Any, kind_name: str, namespace: str, name: str) -> None:
    kind = next(k for k in WORKLOAD_RESOURCES if k.value == kind_name)
    group, version, plural = WORKLOAD_RESOURCES[kind]
    custom.delete_namespaced_custom_object(group, version, namespace, plural, name)


def perseus_jobs(custom: Any, namespace: str) -> dict[str, dict[str, Any]]:
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "perseusjobs")
    return {j["metadata"]["name"]: j for j in listed["items"]}


def policy_status(custom: Any, name: str = POLICY) -> dict[str, Any]:
    try:
        obj = custom.get_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, name)
    except Exception:
        return {}
    status: dict[str, Any] = obj.get("status") or {}
    return status


def event_reasons(core: Any, namespace: str, involved: str) -> set[str]:
    listed = core.list_namespaced_event(namespace)
    return {e.reason for e in listed.items if e.involved_object.name == involved}


def run_opt_in_scenario(core: Any, custom: Any, wait_for: WaitFor) -> None:
    """The scenario; ``wait_for(what, check)`` returns ``check()``'s first truthy value."""
    for name, labels in ((OPTED_IN, {"perseus.energy/enabled": "true"}), (OUTSIDE, {})):
        core.create_namespace(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
    custom.create_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, policy_body())
    create_workload(custom, pytorch_job("gpt3"), OPTED_IN)
    create_workload(custom, jobset("bloom"), OPTED_IN)
    create_workload(
        custom, pytorch_job("private", annotations={OPT_OUT_ANNOTATION: "true"}), OPTED_IN
    )
    create_workload(custom, pytorch_job("web-llm"), OUTSIDE)

    status = wait_for(
        "the policy to manage both workloads",
        lambda: (s := policy_status(custom)).get("managedJobs") == 2 and s,
    )
    assert status["matchedWorkloads"] == 2, status
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Accepted": "True", "Overlapping": "False"}, status
    jobs = perseus_jobs(custom, OPTED_IN)
    assert sorted(jobs) == ["bloom", "gpt3"], sorted(jobs)  # not the opted-out one
    assert perseus_jobs(custom, OUTSIDE) == {}
    gpt3 = jobs["gpt3"]
    assert gpt3["metadata"]["labels"][MANAGED_BY_POLICY_LABEL] == POLICY
    (owner,) = gpt3["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("PyTorchJob", "gpt3", True)
    assert gpt3["spec"]["workload"] == {"kind": "PyTorchJob", "name": "gpt3"}
    assert gpt3["spec"]["parallelism"]["pipelineStages"] == 4
    assert gpt3["spec"]["parallelism"]["dataParallel"] == 8
    assert gpt3["spec"]["policy"]["mode"] == "Observe"
    assert jobs["bloom"]["spec"]["parallelism"]["microbatches"] == 16
    wait_for(
        "the PolicyApplied event on the PyTorchJob",
        lambda: "PolicyApplied" in event_reasons(core, OPTED_IN, "gpt3"),
    )
    # The operator runs the jobs like hand-written ones (no pods yet: it waits for them).
    wait_for(
        "the operator to take up the policy-made job",
        lambda: perseus_jobs(custom, OPTED_IN)["gpt3"].get("status", {}).get("phase"),
    )

    delete_workload(custom, "PyTorchJob", OPTED_IN, "gpt3")
    wait_for("its PerseusJob to go", lambda: "gpt3" not in perseus_jobs(custom, OPTED_IN))
    wait_for("the status to follow", lambda: policy_status(custom).get("managedJobs") == 1)

    custom.delete_cluster_custom_object(GROUP, VERSION, POLICY_PLURAL, POLICY)
    wait_for("the policy's jobs to go with it", lambda: perseus_jobs(custom, OPTED_IN) == {})
    for kind, name in (("JobSet", "bloom"), ("PyTorchJob", "private")):
        delete_workload(custom, kind, OPTED_IN, name)
    delete_workload(custom, "PyTorchJob", OUTSIDE, "web-llm")
