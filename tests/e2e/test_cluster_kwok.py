"""Real scheduling and real training controllers: the chart's agents, a PyTorchJob and a
TrainJob on fake GPU nodes, and the operator's rank resolution on what those controllers write.

Set-up, a control plane of its own (``control_plane.py``): kube-apiserver, etcd,
kube-controller-manager's garbage collector, DaemonSet, node lifecycle and job controllers,
kube-scheduler, KWOK's controller; Kubeflow's training-operator v1.8.1 with its PyTorchJob CRD
and validating webhook (``training_operator.py``); JobSet v0.8.2 and Kubeflow Trainer v2.0.0
with theirs and the ``torch-distributed`` runtime (``kubeflow_trainer.py``); the chart
installed as in the other end-to-end tests. Nodes: three GPU nodes as the GPU Operator leaves
them (``nvidia.com/gpu: 4`` capacity, its ``nvidia.com/gpu.*`` labels, the
``nvidia.com/gpu=present:NoSchedule`` taint) and one CPU node, all faked by KWOK: no kubelet
runs a container, KWOK's stages move the pods the scheduler bound through their phases, and
the test's own stage ends the pods it annotates, Succeeded or Failed.

1. The chart's agent DaemonSet: the DaemonSet controller and the scheduler put one agent pod
   on each GPU node (its node selector and toleration), none on the CPU node; KWOK runs them.
2. A PyTorchJob (a Master and two Workers of four GPUs each, tolerating the taint) made into
   pods and Services by the training-operator, scheduled one per GPU node by the GPU requests,
   Running by KWOK; a PerseusJob on it is resolved by the operator to the pods' nodes and
   (dp, pp, tp) ranks from the controller's labels and variables, and it writes each node's
   plan. KWOK completes the pods, the training-operator marks the PyTorchJob Succeeded, and
   the PerseusJob is Completed with its node plans gone.
3. A PyTorchJob whose Master exits 1 (restartPolicy Never): Failed by the training-operator,
   the PerseusJob Failed with its reason, plans gone.
4. A TrainJob: Trainer makes a JobSet, JobSet an indexed batch Job, the job controller its
   pods; ranked by job index and completion index; completed, TrainJob Complete, the
   PerseusJob Completed.

No node agent runs here (the other end-to-end tests run them as processes), so each job stays
in Profiling until its workload ends.
"""

from __future__ import annotations

from typing import Any

import kubernetes

from perseus_api import resources
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from perseus_operator.workloads.pods import (
    COMPLETION_INDEX,
    JOBSET_JOB_INDEX,
    JOBSET_NAME,
    PYTORCH_JOB_NAME,
    PYTORCH_REPLICA_INDEX,
    PYTORCH_REPLICA_TYPE,
)
from support.cluster_harness import Cluster
from support.kwok_cluster import (
    FINISH_ANNOTATION,
    GPU_NODES,
    GPU_RESOURCE,
    GPUS,
    JOB,
    NAMESPACE,
    SCHEDULER,
    CreatedObjects,
    expected_ranks,
    job_status,
    node_plans,
    perseus_job,
    pytorch_job,
    pytorch_job_condition,
    running_on,
    wait,
)
from support.operator_harness import OperatorProcess

# An assignment's rank fields as expected_ranks names them, and as the operator writes them.
WIRE_KEYS = (
    ("rank", "rank"),
    ("local_rank", "localRank"),
    ("tp_rank", "tpRank"),
    ("dp_rank", "dpRank"),
    ("stage", "stage"),
)


def test_agent_daemonset_is_scheduled_onto_the_gpu_nodes_only(kwok_cluster: Cluster) -> None:
    cluster = kwok_cluster
    apps = kubernetes.client.AppsV1Api(cluster.api)
    (daemonset,) = apps.list_namespaced_daemon_set(cluster.namespace).items
    selector = ",".join(f"{k}={v}" for k, v in daemonset.spec.selector.match_labels.items())

    def agents() -> dict[str, str] | None:
        pods = cluster.core.list_namespaced_pod(cluster.namespace, label_selector=selector).items
        on = running_on(pods)
        return on if len(on) == len(GPU_NODES) and len(pods) == len(GPU_NODES) else None

    on = wait(cluster, "an agent pod Running on each GPU node", agents)
    assert sorted(on.values()) == GPU_NODES  # one each, none on the CPU node
    status = wait(
        cluster,
        "the DaemonSet's status to count them ready",
        lambda: (
            (
                s := apps.read_namespaced_daemon_set(daemonset.metadata.name, cluster.namespace)
            ).status.number_ready
            == len(GPU_NODES)
            and s.status
        ),
    )
    assert status.desired_number_scheduled == len(GPU_NODES)
    # The scheduler, not the test, bound them: its events say so.
    events = cluster.core.list_namespaced_event(cluster.namespace).items
    scheduled = {
        e.involved_object.name
        for e in events
        if e.reason == "Scheduled"
        and SCHEDULER in (e.reporting_component, e.source.component if e.source else None)
    }
    assert set(on) <= scheduled, (sorted(on), sorted(scheduled))


def test_real_pytorchjob_is_resolved_and_its_completion_ends_the_job(
    kwok_training_operator: Cluster, kwok_objects: CreatedObjects
) -> None:
    cluster = kwok_training_operator
    core = cluster.core
    selector = f"{PYTORCH_JOB_NAME}={JOB}"
    kwok_objects.create(
        "kubeflow.org", "v1", "pytorchjobs", pytorch_job(JOB, 2, "OnFailure"), pods=selector
    )

    def training_pods() -> dict[str, str] | None:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        on = running_on(pods)
        return on if len(on) == 3 and len(pods) == 3 else None

    on = wait(cluster, "the training-operator's 3 pods Running", training_pods)
    # One 4-GPU pod per 4-GPU node: the scheduler counted the GPUs (the CPU node has none).
    assert sorted(on.values()) == GPU_NODES, on
    pods = {
        p.metadata.name: p
        for p in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
    }

    # What the real controller wrote, which the operator ranks by.
    node_rank_of: dict[str, int] = {}
    for name, pod in pods.items():
        labels = pod.metadata.labels
        replica_type, index = labels[PYTORCH_REPLICA_TYPE], int(labels[PYTORCH_REPLICA_INDEX])
        node_rank_of[name] = 0 if replica_type == "master" else index + 1
        (trainer,) = [c for c in pod.spec.containers if c.name == PYTORCH_CONTAINER]
        env = {e.name: e.value for e in trainer.env or []}
        assert env["RANK"] == env["PET_NODE_RANK"] == str(node_rank_of[name]), (name, env)
        assert env["PET_NNODES"] == "3", (name, env)
        # Workers wait for the Master in an init container, which KWOK reports finished.
        init = [c.name for c in pod.spec.init_containers or []]
        assert init == ([] if replica_type == "master" else ["init-pytorch"]), (name, init)
    assert sorted(node_rank_of.values()) == [0, 1, 2]

    operator = OperatorProcess(cluster.operator_kubeconfig)
    try:
        kwok_objects.create(resources.GROUP, resources.VERSION, "perseusjobs", perseus_job(JOB, 3))
        # The operator writes the node plans, then the job's status: wait for both (read
        # between the two, the status had no nodes yet: 1 full e2e run in 9).
        plans = operator.wait_for(
            "a node plan on each GPU node, and the nodes in the job's status",
            lambda: (
                len(found := node_plans(cluster, JOB)) == 3
                and "nodes" in job_status(cluster, JOB)
                and found
            ),
        )
        assert job_status(cluster, JOB)["nodes"] == GPU_NODES
        by_node = {p["spec"]["node"]: p["spec"] for p in plans}
        assert sorted(by_node) == GPU_NODES
        for name, node in on.items():
            assignments = sorted(by_node[node]["assignments"], key=lambda a: a["rank"])
            assert {a["pod"] for a in assignments} == {name}, (node, assignments)
            assert {a["podUid"] for a in assignments} == {pods[name].metadata.uid}
            assert {a["container"] for a in assignments} == {PYTORCH_CONTAINER}
            got = [{k: a[wire] for k, wire in WIRE_KEYS} for a in assignments]
            assert got == expected_ranks(node_rank_of[name]), (name, node, got)

        # The training ends: KWOK finishes every pod, the training-operator says Succeeded.
        for name in pods:
            core.patch_namespaced_pod(
                name, NAMESPACE, {"metadata": {"annotations": {FINISH_ANNOTATION: "Succeeded"}}}
            )
        succeeded = wait(
            cluster,
            "the PyTorchJob Succeeded",
            lambda: pytorch_job_condition(cluster, JOB, "Succeeded"),
        )
        assert succeeded["reason"] == "PyTorchJobSucceeded", succeeded
        status = operator.wait_for(
            "the PerseusJob Completed",
            lambda: (s := job_status(cluster, JOB)).get("phase") == "Completed" and s,
        )
        assert "finished" in status["message"], status
        operator.wait_for("its node plans released", lambda: node_plans(cluster, JOB) == [])
    finally:
        print(operator.stop()[-3000:])


def test_real_pytorchjob_failure_fails_the_job(
    kwok_training_operator: Cluster, kwok_objects: CreatedObjects
) -> None:
    """The Master's container exits 1 under restartPolicy Never: the training-operator marks
    the PyTorchJob Failed, and the PerseusJob fails with its reason, plans released."""
    cluster, job = kwok_training_operator, "gpt-kwok-fails"
    kwok_objects.create(
        "kubeflow.org",
        "v1",
        "pytorchjobs",
        pytorch_job(job, 1, "Never"),
        pods=f"{PYTORCH_JOB_NAME}={job}",
    )
    operator = OperatorProcess(cluster.operator_kubeconfig)
    try:
        kwok_objects.create(resources.GROUP, resources.VERSION, "perseusjobs", perseus_job(job, 2))
        operator.wait_for(
            "a node plan on each of its 2 nodes", lambda: len(node_plans(cluster, job)) == 2
        )
        (master,) = cluster.core.list_namespaced_pod(
            NAMESPACE,
            label_selector=f"{PYTORCH_JOB_NAME}={job},{PYTORCH_REPLICA_TYPE}=master",
        ).items
        cluster.core.patch_namespaced_pod(
            master.metadata.name,
            NAMESPACE,
            {"metadata": {"annotations": {FINISH_ANNOTATION: "Failed"}}},
        )
        failed = wait(
            cluster, "the PyTorchJob Failed", lambda: pytorch_job_condition(cluster, job, "Failed")
        )
        status = operator.wait_for(
            "the PerseusJob Failed",
            lambda: (s := job_status(cluster, job)).get("phase") == "Failed" and s,
        )
        # By the controller's Failed condition, not by the Master pod's phase a moment before
        # it: under another restart policy the controller could have run the pod again.
        assert status["message"].startswith(f"PyTorchJob {job} failed ({failed['reason']}"), (
            status,
            failed,
        )
        degraded = [c for c in status["conditions"] if c["type"] == "Degraded"]
        assert degraded and degraded[0]["reason"] == "WorkloadFailed", status
        operator.wait_for("its node plans released", lambda: node_plans(cluster, job) == [])
    finally:
        print(operator.stop()[-3000:])


def test_real_trainjob_is_resolved_and_its_completion_ends_the_job(
    kwok_trainer: Cluster, kwok_objects: CreatedObjects
) -> None:
    """A TrainJob on the torch-distributed runtime: Trainer v2 makes a JobSet, JobSet a batch
    Job, the job controller its indexed pods; the operator ranks them by what those wrote."""
    cluster, job = kwok_trainer, "llama-kwok"
    toleration = {"key": GPU_RESOURCE, "operator": "Exists"}
    body = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": job, "namespace": NAMESPACE},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {"numNodes": 2, "resourcesPerNode": {"limits": {GPU_RESOURCE: GPUS}}},
            "podSpecOverrides": [{"targetJobs": [{"name": "node"}], "tolerations": [toleration]}],
        },
    }
    selector = f"{JOBSET_NAME}={job}"
    kwok_objects.create("trainer.kubeflow.org", "v1alpha1", "trainjobs", body, pods=selector)

    def training_pods() -> dict[str, str] | None:
        pods = cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        on = running_on(pods)
        return on if len(on) == 2 and len(pods) == 2 else None

    on = wait(cluster, "the TrainJob's 2 pods Running", training_pods)
    assert len(set(on.values())) == 2 and set(on.values()) <= set(GPU_NODES), on
    pods = {
        p.metadata.name: p
        for p in cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
    }
    node_rank_of = {
        name: int(p.metadata.labels[JOBSET_JOB_INDEX]) * 2
        + int(p.metadata.annotations[COMPLETION_INDEX])
        for name, p in pods.items()
    }
    assert sorted(node_rank_of.values()) == [0, 1], node_rank_of
    operator = OperatorProcess(cluster.operator_kubeconfig)
    try:
        body = perseus_job(job, 2)
        body["spec"]["workload"] = {"kind": "TrainJob", "name": job}
        kwok_objects.create(resources.GROUP, resources.VERSION, "perseusjobs", body)
        plans = operator.wait_for(
            "a node plan on each of its 2 nodes",
            lambda: len(found := node_plans(cluster, job)) == 2 and found,
        )
        by_node = {p["spec"]["node"]: p["spec"] for p in plans}
        for name, node in on.items():
            assignments = sorted(by_node[node]["assignments"], key=lambda a: a["rank"])
            assert {a["pod"] for a in assignments} == {name}, (node, assignments)
            got = [{k: a[wire] for k, wire in WIRE_KEYS} for a in assignments]
            assert got == expected_ranks(node_rank_of[name], data_parallel=2), (name, got)
        for name in pods:
            cluster.core.patch_namespaced_pod(
                name, NAMESPACE, {"metadata": {"annotations": {FINISH_ANNOTATION: "Succeeded"}}}
            )

        def train_job_complete() -> dict[str, Any] | None:
            found = cluster.custom.get_namespaced_custom_object(
                "trainer.kubeflow.org", "v1alpha1", NAMESPACE, "trainjobs", job
            )
            conditions = (found.get("status") or {}).get("conditions") or []
            return next(
                (c for c in conditions if c["type"] == "Complete" and c["status"] == "True"),
                None,
            )

        complete = wait(cluster, "the TrainJob Complete", train_job_complete)
        status = operator.wait_for(
            "the PerseusJob Completed",
            lambda: (s := job_status(cluster, job)).get("phase") == "Completed" and s,
        )
        assert "finished" in status["message"], (status, complete)
        operator.wait_for("its node plans released", lambda: node_plans(cluster, job) == [])
    finally:
        print(operator.stop()[-3000:])
