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

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from cluster_harness import (
    OPERATOR_SA,
    WORKLOAD_KINDS,
    Cluster,
    api_client,
    install_chart,
    require,
    workload_crd,
)
from control_plane import (
    KWOK_NODE_ANNOTATION,
    KWOK_NODE_VALUE,
    ControlPlane,
    binaries,
    optional_binary,
)
from kubeflow_trainer import start_jobset, start_trainer
from operator_harness import OperatorProcess
from perseus_api import resources
from perseus_operator.workloads import (
    COMPLETION_INDEX,
    GPU_RESOURCE,
    JOBSET_JOB_INDEX,
    JOBSET_NAME,
    PYTORCH_CONTAINER,
    PYTORCH_JOB_NAME,
    PYTORCH_REPLICA_INDEX,
    PYTORCH_REPLICA_TYPE,
)
from training_operator import start_training_operator

pytestmark = pytest.mark.e2e

NAMESPACE = "ml"  # the chart's RBAC lets the operator read workloads and pods there
JOB = "gpt-kwok"
GPUS = 4
GPU_NODES = [f"kwok-gpu-{i}" for i in range(3)]
CPU_NODE = "kwok-cpu-0"
PRODUCT = "NVIDIA-A100-SXM4-80GB"
# What the GPU Operator's feature discovery puts on a node with four A100s.
GPU_NODE_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": PRODUCT,
    "nvidia.com/gpu.count": str(GPUS),
    "nvidia.com/gpu.memory": "81920",
    "nvidia.com/gpu.family": "ampere",
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/cuda.driver.major": "550",
}
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
STAGES, DATA_PARALLEL, TENSOR_PARALLEL, MICROBATCHES = 2, 3, 2, 4
TIMEOUT_S = 120.0
SCHEDULER = "default-scheduler"  # the scheduler's name in the events it writes
# The test's own KWOK stage: a Running pod annotated Succeeded or Failed ends so, as if its
# containers had exited 0 or 1.
FINISH_ANNOTATION = "perseus.test/finish"
FINISH_STAGE: dict[str, Any] = {
    "apiVersion": "kwok.x-k8s.io/v1alpha1",
    "kind": "Stage",
    "metadata": {"name": "pod-finish-when-annotated"},
    "spec": {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {
            "matchExpressions": [
                {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                {
                    "key": f'.metadata.annotations["{FINISH_ANNOTATION}"]',
                    "operator": "In",
                    "values": ["Succeeded", "Failed"],
                },
            ]
        },
        "next": {
            "statusTemplate": f"""{{{{ $now := Now }}}}
{{{{ $phase := index .metadata.annotations "{FINISH_ANNOTATION}" }}}}
containerStatuses:
{{{{ range .spec.containers }}}}
- image: {{{{ .image | Quote }}}}
  name: {{{{ .name | Quote }}}}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated:
      exitCode: {{{{ if eq $phase "Failed" }}}}1{{{{ else }}}}0{{{{ end }}}}
      finishedAt: {{{{ $now | Quote }}}}
      reason: {{{{ if eq $phase "Failed" }}}}Error{{{{ else }}}}Completed{{{{ end }}}}
      startedAt: {{{{ $now | Quote }}}}
{{{{ end }}}}
phase: {{{{ $phase }}}}
"""
        },
    },
}


@pytest.fixture(scope="module")
def kwok_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of this module's own (the session's has stand-in workload CRDs and
    Nodes no KWOK manages), with the scheduler and KWOK, the chart and the fake nodes."""
    pytest.importorskip("helm_python", reason="helm-python-sdk renders the chart")
    found = binaries()
    if isinstance(found, str):
        require(found)
        raise AssertionError("unreachable")
    scheduler, kwok, stages_dir = (
        found_or_require(v)
        for v in ("PERSEUS_KUBE_SCHEDULER_BIN", "PERSEUS_KWOK_BIN", "PERSEUS_KWOK_STAGES")
    )
    stages = sorted(stages_dir.glob("*.yaml"))
    if not stages:
        require(f"no KWOK stages in {stages_dir}")
    plane = ControlPlane(
        tmp_path_factory.mktemp("kwok-control-plane"),
        *found,
        # The API server taints every new Node not-ready (TaintNodesByCondition); the node
        # lifecycle controller lifts it once KWOK reports the node Ready, as for a kubelet.
        # The job controller for Trainer v2's TrainJob (a JobSet of batch Jobs).
        controllers=("garbagecollector", "daemonset", "nodelifecycle", "job"),
        # KWOK's heartbeats come every 20-45 s: a loaded machine must not make nodes NotReady.
        controller_manager_flags=("--node-monitor-grace-period=180s",),
        scheduler=scheduler,
        kwok=kwok,
        kwok_stages=[*stages, FINISH_STAGE],
    )
    try:
        plane.start()
        # The PyTorchJob CRD is the training-operator's own (the fixture below installs it).
        stand_ins = [workload_crd(*kind) for kind in WORKLOAD_KINDS if kind[2] != "PyTorchJob"]
        namespace = install_chart(plane, stand_ins)
        plane.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
        with api_client(plane.admin_kubeconfig) as api:
            operator = plane.service_account_kubeconfig(namespace, OPERATOR_SA)
            cluster = Cluster(plane, api, operator, namespace)
            for node in GPU_NODES:
                fake_node(cluster, node, gpu=True)
            fake_node(cluster, CPU_NODE, gpu=False)
            yield cluster
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def training_operator(kwok_cluster: Cluster) -> Cluster:
    """The training-operator, its PyTorchJob CRD and webhook on ``kwok_cluster``."""
    binary, manifests = (
        found_or_require(v)
        for v in ("PERSEUS_TRAINING_OPERATOR_BIN", "PERSEUS_TRAINING_OPERATOR_MANIFESTS")
    )
    start_training_operator(kwok_cluster.plane, binary, manifests)
    return kwok_cluster


@pytest.fixture(scope="module")
def trainer(kwok_cluster: Cluster) -> Cluster:
    """JobSet's and Trainer v2's controllers, CRDs and webhooks on ``kwok_cluster``."""
    jobset, jobset_manifests, trainer, trainer_manifests = (
        found_or_require(v)
        for v in (
            "PERSEUS_JOBSET_BIN",
            "PERSEUS_JOBSET_MANIFESTS",
            "PERSEUS_TRAINER_BIN",
            "PERSEUS_TRAINER_MANIFESTS",
        )
    )
    start_jobset(kwok_cluster.plane, jobset, jobset_manifests)
    start_trainer(kwok_cluster.plane, trainer, trainer_manifests)
    return kwok_cluster


def found_or_require(variable: str) -> Path:
    path = optional_binary(variable)
    if isinstance(path, str):
        require(path)
        raise AssertionError("unreachable")
    return path


def fake_node(cluster: Cluster, name: str, *, gpu: bool) -> None:
    """A Node KWOK manages (its annotation): Ready once KWOK has seen it."""
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    if gpu:
        capacity[GPU_RESOURCE] = str(GPUS)
    cluster.core.create_node(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE},
                "labels": {"kubernetes.io/hostname": name, "type": "kwok"}
                | (GPU_NODE_LABELS if gpu else {}),
            },
            "spec": {"taints": [GPU_TAINT] if gpu else []},
            "status": {"capacity": capacity, "allocatable": capacity},
        }
    )


def wait(cluster: Cluster, what: str, check: Any, timeout_s: float = TIMEOUT_S) -> Any:
    """``check()``'s first truthy value; on time-out fails with the components' logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    logs = "\n".join(
        f"---- {name} ----\n{cluster.plane.log(name)[-4000:]}"
        for name in (
            "kube-scheduler",
            "kwok",
            "kube-controller-manager",
            "training-operator",
            "jobset",
            "trainer",
        )
    )
    pytest.fail(f"timed out waiting for {what}\n{logs}")


def running_on(pods: list[Any]) -> dict[str, str]:
    """Pod name -> node, of the pods that are bound and Running."""
    return {
        p.metadata.name: p.spec.node_name
        for p in pods
        if p.spec.node_name and p.status.phase == "Running"
    }


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


def pytorch_job(name: str, workers: int, restart_policy: str) -> dict[str, Any]:
    """A Master and ``workers`` Workers, four GPUs each, tolerating the GPU nodes' taint."""

    def replica(replicas: int) -> dict[str, Any]:
        return {
            "replicas": replicas,
            "restartPolicy": restart_policy,
            "template": {
                "spec": {
                    "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists"}],
                    "containers": [
                        {"name": "metrics-sidecar", "image": "exporter"},
                        {
                            "name": PYTORCH_CONTAINER,
                            "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                            "resources": {"limits": {GPU_RESOURCE: str(GPUS)}},
                        },
                    ],
                }
            },
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(workers)}},
    }


def perseus_job(name: str, data_parallel: int) -> dict[str, Any]:
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "workload": {"kind": "PyTorchJob", "name": name},
            "parallelism": {
                "pipelineStages": STAGES,
                "dataParallel": data_parallel,
                "tensorParallel": TENSOR_PARALLEL,
                "microbatches": MICROBATCHES,
            },
            "policy": {"blockingPowerWatts": 80.0},
        },
    }


def node_plans(cluster: Cluster, job: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.custom.list_namespaced_custom_object(
        resources.GROUP,
        resources.VERSION,
        NAMESPACE,
        resources.NODE_PLAN_PLURAL,
        label_selector=f"{resources.JOB_LABEL}={job}",
    )["items"]
    return items


def job_status(cluster: Cluster, job: str) -> dict[str, Any]:
    found = cluster.custom.get_namespaced_custom_object(
        resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", job
    )
    return dict(found.get("status") or {})


def pytorch_job_condition(cluster: Cluster, job: str, kind: str) -> dict[str, Any] | None:
    """The PyTorchJob's condition ``kind`` when True, as the training-operator wrote it."""
    found = cluster.custom.get_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", job
    )
    conditions = (found.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind and c["status"] == "True"), None)


def expected_ranks(node_rank: int, data_parallel: int = 3) -> list[dict[str, int]]:
    """The ranks of the pod with ``node_rank`` under the default tp-dp-pp order, computed
    here independently of the operator's code: rank = node rank x GPUs + local GPU."""
    ranks = []
    for local in range(GPUS):
        rank = node_rank * GPUS + local
        rest = rank // TENSOR_PARALLEL
        ranks.append(
            {
                "rank": rank,
                "local_rank": local,
                "tp_rank": rank % TENSOR_PARALLEL,
                "dp_rank": rest % data_parallel,
                "stage": rest // data_parallel,
            }
        )
    return ranks


def test_real_pytorchjob_is_resolved_and_its_completion_ends_the_job(
    training_operator: Cluster,
) -> None:
    cluster = training_operator
    core, custom = cluster.core, cluster.custom
    custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", pytorch_job(JOB, 2, "OnFailure")
    )
    selector = f"{PYTORCH_JOB_NAME}={JOB}"

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
        custom.create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", perseus_job(JOB, 3)
        )
        plans = operator.wait_for(
            "a node plan on each GPU node",
            lambda: len(found := node_plans(cluster, JOB)) == 3 and found,
        )
        assert job_status(cluster, JOB)["nodes"] == GPU_NODES
        by_node = {p["spec"]["node"]: p["spec"] for p in plans}
        assert sorted(by_node) == GPU_NODES
        for name, node in on.items():
            assignments = sorted(by_node[node]["assignments"], key=lambda a: a["rank"])
            assert {a["pod"] for a in assignments} == {name}, (node, assignments)
            assert {a["pod_uid"] for a in assignments} == {pods[name].metadata.uid}
            assert {a["container"] for a in assignments} == {PYTORCH_CONTAINER}
            got = [
                {k: a[k] for k in ("rank", "local_rank", "tp_rank", "dp_rank", "stage")}
                for a in assignments
            ]
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


def test_real_pytorchjob_failure_fails_the_job(training_operator: Cluster) -> None:
    """The Master's container exits 1 under restartPolicy Never: the training-operator marks
    the PyTorchJob Failed, and the PerseusJob fails with its reason, plans released."""
    cluster, job = training_operator, "gpt-kwok-fails"
    cluster.custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", pytorch_job(job, 1, "Never")
    )
    operator = OperatorProcess(cluster.operator_kubeconfig)
    try:
        cluster.custom.create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", perseus_job(job, 2)
        )
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
        assert status["message"].startswith(f"PyTorchJob {job} failed ({failed['reason']}"), (
            status,
            failed,
        )
        operator.wait_for("its node plans released", lambda: node_plans(cluster, job) == [])
    finally:
        print(operator.stop()[-3000:])


def test_real_trainjob_is_resolved_and_its_completion_ends_the_job(trainer: Cluster) -> None:
    """A TrainJob on the torch-distributed runtime: Trainer v2 makes a JobSet, JobSet a batch
    Job, the job controller its indexed pods; the operator ranks them by what those wrote."""
    cluster, job = trainer, "llama-kwok"
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
    cluster.custom.create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", NAMESPACE, "trainjobs", body
    )
    selector = f"{JOBSET_NAME}={job}"

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
        cluster.custom.create_namespaced_custom_object(
            resources.GROUP, resources.VERSION, NAMESPACE, "perseusjobs", body
        )
        plans = operator.wait_for(
            "a node plan on each of its 2 nodes",
            lambda: len(found := node_plans(cluster, job)) == 2 and found,
        )
        by_node = {p["spec"]["node"]: p["spec"] for p in plans}
        for name, node in on.items():
            assignments = sorted(by_node[node]["assignments"], key=lambda a: a["rank"])
            assert {a["pod"] for a in assignments} == {name}, (node, assignments)
            got = [
                {k: a[k] for k in ("rank", "local_rank", "tp_rank", "dp_rank", "stage")}
                for a in assignments
            ]
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
