"""Training workloads as the API server returns them (PyTorchJob, JobSet, TrainJob, pods of an
indexed Job) and the namespaces they live in: shared by the policy tests (unit, kmock and the
real API server)."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

NAMESPACES: dict[str, dict[str, str]] = {
    "ml": {
        "kubernetes.io/metadata.name": "ml",
        "perseus.energy/enabled": "true",
        "team": "research",
    },
    "ml-prod": {
        "kubernetes.io/metadata.name": "ml-prod",
        "perseus.energy/enabled": "true",
        "team": "serving",
        "tier": "prod",
    },
    "web": {"kubernetes.io/metadata.name": "web", "team": "frontend"},
}


def container(
    name: str, gpus: int | str | None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": "nvcr.io/nvidia/pytorch:24.05-py3"}
    if gpus is not None:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus, "cpu": "32"}}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return container


def pytorch_job(
    name: str = "gpt3",
    namespace: str = "ml",
    *,
    workers: int = 3,
    gpus: int | str | None = 8,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> Obj:
    """A Kubeflow PyTorchJob: a Master and ``workers`` Workers, ``gpus`` GPUs per pod."""
    annotations = {"perseus.energy/pipeline-stages": "4", "perseus.energy/microbatches": "8"} | (
        annotations or {}
    )

    def replica(replicas: int) -> dict[str, Any]:
        return {
            "replicas": replicas,
            "restartPolicy": "OnFailure",
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        container("metrics-sidecar", None),
                        container("pytorch", gpus, env),
                    ]
                },
            },
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-pytorchjob-{name}",
            "labels": {"team": "llm"} | (labels or {}),
            "annotations": annotations,
        },
        "spec": {
            "nprocPerNode": "auto",
            "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(workers)},
        },
    }


def jobset(
    name: str = "bloom",
    namespace: str = "ml",
    *,
    replicas: int = 2,
    parallelism: int = 2,
    gpus: int = 4,
    env: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> Obj:
    """A JobSet: a CPU initializer, and ``replicas`` indexed Jobs of ``parallelism`` GPU pods
    that state their pipeline layout as container variables."""
    env = {"PERSEUS_PIPELINE_STAGES": "4", "PERSEUS_MICROBATCHES": "16"} | (env or {})

    def replicated(job: str, count: int, pods: int, container: dict[str, Any]) -> Obj:
        return {
            "name": job,
            "replicas": count,
            "template": {
                "spec": {
                    "parallelism": pods,
                    "completions": pods,
                    "completionMode": "Indexed",
                    "template": {"spec": {"containers": [container]}},
                }
            },
        }

    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-jobset-{name}",
            "labels": labels or {},
        },
        "spec": {
            "replicatedJobs": [
                replicated("initializer", 1, 1, container("init", None)),
                replicated("trainer", replicas, parallelism, container("trainer", gpus, env)),
            ]
        },
    }


def train_job(name: str = "llama", namespace: str = "ml", **trainer: Any) -> Obj:
    """A Kubeflow Trainer v2 TrainJob on the torch-distributed runtime."""
    spec = {
        "numNodes": 2,
        "resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}},
        "env": [
            {"name": "PERSEUS_PIPELINE_STAGES", "value": "8"},
            {"name": "PERSEUS_MICROBATCHES", "value": "32"},
        ],
    } | trainer
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-trainjob-{name}"},
        "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": spec},
    }


def job_pod(
    job: str,
    index: int,
    namespace: str = "ml",
    *,
    app: str = "mistral-train",
    gpus: int = 8,
    nnodes: str | None = "2",
    annotations: dict[str, str] | None = None,
) -> Obj:
    """A pod of an indexed batch Job ``job`` (a labelled-pods workload)."""
    env = {"MASTER_ADDR": f"{job}-0.{job}"} | ({"PET_NNODES": nnodes} if nnodes else {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{index}-x7k2p",
            "namespace": namespace,
            "labels": {
                "app": app,
                "batch.kubernetes.io/job-name": job,
                "job-name": job,
                "batch.kubernetes.io/controller-uid": f"uid-job-{job}",
                "controller-uid": f"uid-job-{job}",
                "batch.kubernetes.io/job-completion-index": str(index),
            },
            "annotations": {
                "perseus.energy/pipeline-stages": "2",
                "perseus.energy/microbatches": "8",
                "batch.kubernetes.io/job-completion-index": str(index),
            }
            | (annotations or {}),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job,
                    "uid": f"uid-job-{job}",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "containers": [container("trainer", gpus, env)],
            "nodeName": f"gpu-node-{index}",
        },
        "status": {"phase": "Running"},
    }
