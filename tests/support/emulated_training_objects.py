"""The emulated training's objects on the cluster: its PyTorchJob (a stand-in: no training
operator runs), the pods the training operator would make, and the PerseusJob of it."""

from __future__ import annotations

from typing import Any

from perseus_api import resources
from perseus_operator.workloads.objects import PYTORCH_CONTAINER
from perseus_operator.workloads.pods import (
    GPU_RESOURCE,
    PYTORCH_JOB_NAME,
    PYTORCH_REPLICA_INDEX,
    PYTORCH_REPLICA_TYPE,
)
from support.emulated_training import BLOCKING_W, GPUS, MICROBATCHES, REPLICAS, STAGES

NAMESPACE = "ml"


def pytorch_job(
    name: str, *, namespace: str = NAMESPACE, replica_types: tuple[str, ...] = ("Master", "Worker")
) -> dict[str, Any]:
    replica = {
        "replicas": 1,
        "template": {"spec": {"containers": [{"name": PYTORCH_CONTAINER, "image": "trainer"}]}},
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"pytorchReplicaSpecs": dict.fromkeys(replica_types, replica)},
    }


def training_pod(
    job: str, replica_type: str, node: str, *, namespace: str = NAMESPACE
) -> dict[str, Any]:
    """A pod as the training operator makes it, bound to ``node`` as the scheduler would."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-{replica_type}-0",
            "namespace": namespace,
            "labels": {
                PYTORCH_JOB_NAME: job,
                PYTORCH_REPLICA_TYPE: replica_type,
                PYTORCH_REPLICA_INDEX: "0",
            },
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": PYTORCH_CONTAINER,
                    "image": "trainer",
                    "resources": {"limits": {GPU_RESOURCE: str(GPUS)}},
                }
            ],
        },
    }


def perseus_job(name: str, workload: str, **policy: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "workload": {"kind": "PyTorchJob", "name": workload},
        "parallelism": {
            "pipelineStages": STAGES,
            "dataParallel": REPLICAS,
            "microbatches": MICROBATCHES,
        },
        # Node k runs replica k (the emulated job's layout): one slow node, one slow replica.
        "rankMapping": {"order": "tp-pp-dp"},
        "policy": {"blockingPowerWatts": BLOCKING_W, **policy},
        "profiling": {"iterationsPerFrequency": 2, "warmupIterations": 1, "frequencyStepMHz": 30},
        "stragglers": {"persistenceReports": 2, "warmupIterations": 2, "windowIterations": 3},
    }
    return {
        "apiVersion": resources.API_VERSION,
        "kind": "PerseusJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }
