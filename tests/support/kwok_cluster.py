"""The KWOK end-to-end tests' cluster (``tests/e2e/test_cluster_kwok.py``): a control plane of
their own with kube-scheduler, KWOK and the DaemonSet, node lifecycle and job controllers, the
chart, fake GPU nodes as the GPU Operator leaves them, and, as fixtures of their own, the
training-operator and Trainer v2 + JobSet; and the workloads the tests run on it.

A pytest plugin (``pytest_plugins`` in ``tests/conftest.py``): the module-scoped fixtures
``kwok_cluster``, ``kwok_training_operator`` and ``kwok_trainer``, and ``kwok_objects``, what
one test creates there, deleted when it ends.
Without a binary they need they skip with the reason, or fail under ``PERSEUS_REQUIRE_E2E=1``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from perseus_api import resources
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from perseus_operator.workloads.pods import GPU_RESOURCE
from support.cluster_harness import (
    OPERATOR_SA,
    WORKLOAD_KINDS,
    Cluster,
    api_client,
    install_chart,
    require,
    workload_crd,
)
from support.control_plane import (
    KWOK_NODE_ANNOTATION,
    KWOK_NODE_VALUE,
    ControlPlane,
    binaries,
    optional_binary,
)
from support.kubeflow_trainer import start_jobset, start_trainer
from support.training_operator import start_training_operator

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
def kwok_training_operator(kwok_cluster: Cluster) -> Cluster:
    """The training-operator, its PyTorchJob CRD and webhook on ``kwok_cluster``."""
    binary, manifests = (
        found_or_require(v)
        for v in ("PERSEUS_TRAINING_OPERATOR_BIN", "PERSEUS_TRAINING_OPERATOR_MANIFESTS")
    )
    start_training_operator(kwok_cluster.plane, binary, manifests)
    return kwok_cluster


@pytest.fixture(scope="module")
def kwok_trainer(kwok_cluster: Cluster) -> Cluster:
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


class CreatedObjects:
    """What one test created in ``NAMESPACE``, deleted when it ends, passed or failed: a failed
    test must leave neither pods holding the fake nodes' GPUs nor a PerseusJob to the tests
    after it (one failure used to fail the next two: their pods stayed Pending)."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._created: list[tuple[str, str, str, str, str | None]] = []

    def create(
        self, group: str, version: str, plural: str, body: dict[str, Any], pods: str | None = None
    ) -> None:
        """Create ``body``; ``pods``: the label selector of the pods it makes, waited out."""
        self._cluster.custom.create_namespaced_custom_object(
            group, version, NAMESPACE, plural, body
        )
        self._created.append((group, version, plural, body["metadata"]["name"], pods))

    def delete_all(self) -> None:
        """Newest first (the PerseusJob before its workload), then wait until all are gone."""
        custom = self._cluster.custom
        for group, version, plural, name, _ in reversed(self._created):
            with _absent_ok():
                custom.delete_namespaced_custom_object(
                    group, version, NAMESPACE, plural, name, propagation_policy="Background"
                )
            if plural == "perseusjobs":
                # The test has stopped its operator: no one else would remove the finalizer.
                with _absent_ok():
                    custom.patch_namespaced_custom_object(
                        group, version, NAMESPACE, plural, name, {"metadata": {"finalizers": None}}
                    )
        for group, version, plural, name, pods in self._created:
            gone = functools.partial(self._gone, group, version, plural, name)
            wait(self._cluster, f"{plural} {name} deleted", gone)
            if pods is not None:
                no_pods = functools.partial(self._no_pods, pods)
                wait(self._cluster, f"the pods of {plural} {name} deleted", no_pods)
        self._created.clear()

    def _no_pods(self, selector: str) -> bool:
        return not self._cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items

    def _gone(self, group: str, version: str, plural: str, name: str) -> bool:
        try:
            self._cluster.custom.get_namespaced_custom_object(
                group, version, NAMESPACE, plural, name
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False


@contextlib.contextmanager
def _absent_ok() -> Iterator[None]:
    try:
        yield
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture
def kwok_objects(kwok_cluster: Cluster) -> Iterator[CreatedObjects]:
    """Create a test's objects through this; they are deleted when the test ends."""
    created = CreatedObjects(kwok_cluster)
    try:
        yield created
    finally:
        created.delete_all()


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
