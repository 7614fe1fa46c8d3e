"""A training pod's fields as the workload kinds write them: the labels and variables that
carry its rank, the GPUs it requests, its node, phase and UID.

Pure functions over pods as the API server returns them (plain dicts); a field that is there
but unreadable raises :class:`WorkloadError`, which says what to fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from perseus_operator.workloads.objects import (
    INTEGER,
    containers_of,
    get_path,
    labels_of,
    training_container,
)

Pod = Mapping[str, Any]

GPU_RESOURCE: Final = "nvidia.com/gpu"

PYTORCH_JOB_NAME: Final = "training.kubeflow.org/job-name"
PYTORCH_REPLICA_TYPE: Final = "training.kubeflow.org/replica-type"
PYTORCH_REPLICA_INDEX: Final = "training.kubeflow.org/replica-index"
# The training operator sets both on the ``pytorch`` container; torchrun reads PET_NODE_RANK.
PYTORCH_RANK_ENVS: Final = ("PET_NODE_RANK", "RANK")

JOBSET_NAME: Final = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB: Final = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_JOB_INDEX: Final = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX: Final = "batch.kubernetes.io/job-completion-index"

# torchrun's node count; when a pod states it, a short workload is an error, not a wait.
NNODES_ENV: Final = "PET_NNODES"

_METADATA_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")


class WorkloadError(Exception):
    """The workload's pods cannot run the declared parallelism; the message says what to fix.

    A mismatch between the job's spec and the cluster, not malformed data: not an
    :class:`~perseus_api.errors.ApiError` (a ``ValueError``)."""


def pod_name(pod: Pod) -> str:
    """The pod's name, for messages (``<unnamed pod>`` when it has none)."""
    name = get_path(pod, "metadata", "name")
    return name if isinstance(name, str) and name else "<unnamed pod>"


def label_or_annotation(pod: Pod, key: str) -> Any:
    """The pod's label ``key``, else its annotation ``key`` (``None`` when neither)."""
    # JobSet and indexed Jobs write their indexes as annotations, and also as labels in
    # recent versions: take whichever is there.
    value = labels_of(pod).get(key)
    return value if value is not None else get_path(pod, "metadata", "annotations", key)


def container_name(container: Mapping[str, Any]) -> str:
    """The container's name, for messages (``<unnamed>`` when it has none)."""
    name = container.get("name")
    return name if isinstance(name, str) else "<unnamed>"


def node_of(pod: Pod) -> str | None:
    """The node the pod is scheduled on; ``None`` before it is."""
    node = get_path(pod, "spec", "nodeName")
    return node if isinstance(node, str) and node else None


def phase_of(pod: Pod) -> str | None:
    """The pod's phase (``Pending``, ``Running``, ``Succeeded``, ``Failed``...), if it has one."""
    phase = get_path(pod, "status", "phase")
    return phase if isinstance(phase, str) else None


def gpu_container(pod: Pod) -> str | None:
    """The container whose ``nvidia.com/gpu`` the kubelet allocates: the only one requesting
    GPUs, else the training container; ``None`` when that cannot be told (the agent then
    takes the GPUs of all the pod's containers)."""
    requesting = [
        c
        for c in containers_of(pod)
        if any(
            get_path(c, "resources", section, GPU_RESOURCE) not in (None, 0, "0")
            for section in ("limits", "requests")
        )
    ]
    if len(requesting) == 1:
        return container_name(requesting[0])
    if requesting:
        return None
    training = training_container(pod)
    return None if training is None else container_name(training)


def uid_of(pod: Pod) -> str | None:
    """The pod's UID, if it has one."""
    uid = get_path(pod, "metadata", "uid")
    return uid if isinstance(uid, str) and uid else None


def env_entry(container: Mapping[str, Any], variable: str) -> Mapping[str, Any] | None:
    """The container's ``env`` entry of ``variable``, as written (literal or ``valueFrom``)."""
    env = container.get("env")
    if not isinstance(env, list):
        return None
    return next(
        (e for e in env if isinstance(e, Mapping) and e.get("name") == variable),
        None,
    )


def env_value(pod: Pod, container: Mapping[str, Any] | None, variable: str) -> str | None:
    """The variable's value when it can be known from the pod: a literal, or a downward-API
    reference to one of the pod's labels or annotations (how indexed Jobs pass
    ``JOB_COMPLETION_INDEX``). ``None`` when unset or taken from elsewhere."""
    entry = None if container is None else env_entry(container, variable)
    if entry is None:
        return None
    source = entry.get("valueFrom")
    if source is None:
        value = entry.get("value", "")
        return value if isinstance(value, str) else str(value)
    field = _METADATA_FIELD.fullmatch(str(get_path(source, "fieldRef", "fieldPath") or ""))
    if field is None:
        return None
    value = get_path(pod, "metadata", field.group(1), field.group(2))
    return None if value is None else str(value)


def parse_index(value: object, pod: str, source: str, fix: str) -> int:
    """A non-negative integer read from a pod, or an error naming the pod and the fix."""
    if value is None:
        raise WorkloadError(f"pod {pod} has no {source}; {fix}")
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not INTEGER.fullmatch(text.strip()):
        raise WorkloadError(f"pod {pod}: {source} is {value!r}, not a non-negative integer; {fix}")
    return int(text)


def gpus_of(pod: Pod) -> int:
    """GPUs the pod's containers request (``nvidia.com/gpu``); init containers hold none
    while training runs."""
    total = 0
    for container in containers_of(pod):
        for section in ("limits", "requests"):
            value = get_path(container, "resources", section, GPU_RESOURCE)
            if value is not None:
                total += parse_index(
                    value,
                    pod_name(pod),
                    f"{section} {GPU_RESOURCE} of container {container_name(container)}",
                    "request whole GPUs",
                )
                break
    return total


def replicated_job(pod: Pod) -> str:
    """The JobSet replicated job the pod belongs to ("" when none)."""
    return str(label_or_annotation(pod, JOBSET_REPLICATED_JOB) or "")
