"""A pod's node rank under its workload kind's convention: one function per kind.

* PyTorchJob (Kubeflow training operator v1): the Master is node rank 0 and Worker ``i`` is
  ``i + 1`` (``i`` when the job has no Master), as the operator's own ``RANK`` and
  ``PET_NODE_RANK`` variables say.
* JobSet, and TrainJob (Kubeflow Trainer v2 runs one as a JobSet of the same name): job
  index times pods per job plus the pod's completion index in its indexed Job.
* Pods: a label, a container variable, or the indexed Job's completion index.

A new workload kind adds its convention here (and its pods' fields to
:mod:`perseus_operator.workloads.pods`).
"""

from __future__ import annotations

from collections.abc import Sequence

from perseus_api.job import RankMapping, Workload, WorkloadKind
from perseus_operator.workloads.objects import containers_of, labels_of, training_container
from perseus_operator.workloads.pods import (
    COMPLETION_INDEX,
    JOBSET_JOB_INDEX,
    PYTORCH_RANK_ENVS,
    PYTORCH_REPLICA_INDEX,
    PYTORCH_REPLICA_TYPE,
    Pod,
    WorkloadError,
    container_name,
    env_entry,
    env_value,
    label_or_annotation,
    parse_index,
    pod_name,
    replicated_job,
)


def node_rank(
    pod: Pod,
    workload: Workload,
    mapping: RankMapping,
    peers: Sequence[Pod] | None = None,
) -> int:
    """The pod's node rank under the workload kind's convention.

    ``peers`` are the workload's training pods: whether a PyTorchJob has a Master, and how
    many pods each JobSet job has, is only known from all of them. Without them the pod is
    ranked as if it were alone.
    """
    group = [*(peers or ()), pod]
    if workload.kind == WorkloadKind.PYTORCH_JOB:
        return _pytorch_node_rank(pod, has_master=any(_is_master(p) for p in group))
    if workload.kind in (WorkloadKind.JOB_SET, WorkloadKind.TRAIN_JOB):
        return _jobset_node_rank(pod, group)
    return _pods_node_rank(pod, mapping)


def _is_master(pod: Pod) -> bool:
    # Old training operators wrote "Master", recent ones "master".
    return str(labels_of(pod).get(PYTORCH_REPLICA_TYPE, "")).lower() == "master"


def _pytorch_node_rank(pod: Pod, *, has_master: bool) -> int:
    name = pod_name(pod)
    from_labels = _pytorch_label_rank(pod, has_master=has_master)
    from_env = _pytorch_env_rank(pod)
    if from_env is None:
        if from_labels is None:
            raise WorkloadError(
                f"pod {name} has neither {PYTORCH_REPLICA_TYPE} and {PYTORCH_REPLICA_INDEX} "
                f"labels nor a {' or '.join(PYTORCH_RANK_ENVS)} variable: is it a pod of "
                "the training operator? For other pods use kind Pods"
            )
        return from_labels
    variable, rank = from_env
    if from_labels is not None and from_labels != rank:
        raise WorkloadError(
            f"pod {name}: its replica labels give node rank {from_labels} but {variable} is "
            f"{rank}; do not override {variable} in a PyTorchJob"
        )
    return rank


def _pytorch_label_rank(pod: Pod, *, has_master: bool) -> int | None:
    labels = labels_of(pod)
    replica_type = labels.get(PYTORCH_REPLICA_TYPE)
    if replica_type is None or labels.get(PYTORCH_REPLICA_INDEX) is None:
        return None
    name = pod_name(pod)
    index = parse_index(
        labels[PYTORCH_REPLICA_INDEX],
        name,
        f"label {PYTORCH_REPLICA_INDEX}",
        "the training operator sets it; was the label edited?",
    )
    kind = str(replica_type).lower()
    if kind == "master":
        if index != 0:
            raise WorkloadError(
                f"pod {name} is Master replica {index}; a PyTorchJob has one Master replica"
            )
        return 0
    if kind == "worker":
        return index + 1 if has_master else index
    raise WorkloadError(
        f"pod {name} has replica type {replica_type!r}; Perseus ranks the Master and Worker "
        "replicas of a PyTorchJob"
    )


def _pytorch_env_rank(pod: Pod) -> tuple[str, int] | None:
    container = training_container(pod)
    found: list[tuple[str, int]] = []
    for variable in PYTORCH_RANK_ENVS:
        value = env_value(pod, container, variable)
        if value is not None:
            fix = "it must be the pod's node rank"
            found.append((variable, parse_index(value, pod_name(pod), f"variable {variable}", fix)))
    if len({rank for _, rank in found}) > 1:
        listed = ", ".join(f"{variable} {rank}" for variable, rank in found)
        raise WorkloadError(f"pod {pod_name(pod)} has conflicting node ranks: {listed}")
    return found[0] if found else None


def _completion_index(pod: Pod) -> int:
    return parse_index(
        label_or_annotation(pod, COMPLETION_INDEX),
        pod_name(pod),
        f"{COMPLETION_INDEX} label or annotation",
        "the JobSet's jobs must use completionMode Indexed",
    )


def _jobset_node_rank(pod: Pod, group: Sequence[Pod]) -> int:
    job_index = parse_index(
        label_or_annotation(pod, JOBSET_JOB_INDEX),
        pod_name(pod),
        f"{JOBSET_JOB_INDEX} label or annotation",
        "is it a pod of a JobSet?",
    )
    replicated = replicated_job(pod)
    pods_per_job = len({_completion_index(p) for p in group if replicated_job(p) == replicated})
    return job_index * pods_per_job + _completion_index(pod)


def _pods_node_rank(pod: Pod, mapping: RankMapping) -> int:
    name = pod_name(pod)
    if mapping.node_rank_label is not None:
        return parse_index(
            labels_of(pod).get(mapping.node_rank_label),
            name,
            f"label {mapping.node_rank_label}",
            "label every training pod with its node rank, or unset rankMapping.nodeRankLabel",
        )
    variable = mapping.node_rank_env
    holder = next((c for c in containers_of(pod) if env_entry(c, variable) is not None), None)
    value = env_value(pod, holder, variable)
    if holder is not None and value is not None:
        return parse_index(
            value,
            name,
            f"variable {variable} of container {container_name(holder)}",
            "it must be the pod's node rank",
        )
    return parse_index(
        label_or_annotation(pod, COMPLETION_INDEX),
        name,
        f"{variable} variable with a literal value nor a {COMPLETION_INDEX} label or annotation",
        "set rankMapping.nodeRankLabel or rankMapping.nodeRankEnv to where each pod's node rank is",
    )
