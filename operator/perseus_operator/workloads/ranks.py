"""Which GPU runs which training rank: a workload's pods resolved to (dp, pp, tp) ranks.

Pure functions over pods as the Kubernetes API returns them (plain dicts), so that every
convention below is tested without a cluster. The rank convention is the one of
:class:`perseus_api.job.RankMapping`: a pod with node rank ``n`` runs ``gpusPerPod``
processes, process ``local`` has global rank ``n * gpusPerPod + local`` and runs on the
``local``-th GPU the kubelet allocated to the pod's GPU container: which GPU of the node that
is, only the node's agent knows (from the kubelet's PodResources API), so a placement names
the pod, its UID, the container and the local rank, never a node GPU index. Several pods may
share a node. Only the node rank differs between workload kinds:

* PyTorchJob (Kubeflow training operator v1): the Master is node rank 0 and Worker ``i`` is
  ``i + 1`` (``i`` when the job has no Master), as the operator's own ``RANK`` and
  ``PET_NODE_RANK`` variables say.
* JobSet, and TrainJob (Kubeflow Trainer v2 runs one as a JobSet of the same name): job
  index times pods per job plus the pod's completion index in its indexed Job.
* Pods: a label, a container variable, or the indexed Job's completion index.

A workload that is still starting up is not an error: :func:`resolve_ranks` then says what
it waits for. Layouts that can never work raise :class:`WorkloadError`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from perseus_api.job import (
    LabelSelector,
    LabelSelectorRequirement,
    Parallelism,
    RankMapping,
    RankOrder,
    Workload,
    WorkloadKind,
)
from perseus_operator.workloads.objects import (
    INTEGER,
    containers_of,
    get_path,
    labels_of,
    listed,
    training_container,
)
from perseus_operator.workloads.objects import PYTORCH_CONTAINER as PYTORCH_CONTAINER  # re-exported

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
_LISTED_NAMES = 5


class WorkloadError(Exception):
    """The workload's pods cannot run the declared parallelism; the message says what to fix.

    A mismatch between the job's spec and the cluster, not malformed data: not an
    :class:`~perseus_api.errors.ApiError` (a ``ValueError``)."""


@dataclass(frozen=True)
class RankPlacement:
    """Where one training process runs, and its coordinates in the parallel layout."""

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    pod: str
    node: str
    local_rank: int
    container: str | None = None
    """The pod's container holding the GPUs (``None``: any of them)."""
    pod_uid: str | None = None

    @property
    def gpu_key(self) -> str:
        """Names this process's GPU among the node's, for telling jobs' claims apart."""
        return f"{self.pod}#{self.local_rank}"


@dataclass(frozen=True)
class Resolution:
    """Either every rank's placement (sorted by rank), or why they are not known yet."""

    ranks: tuple[RankPlacement, ...] = ()
    waiting: str | None = None

    def __post_init__(self) -> None:
        if bool(self.ranks) == (self.waiting is not None):
            raise ValueError("a Resolution has either ranks or a waiting message")


# -- selectors -------------------------------------------------------------------------------------


def pod_selector(workload: Workload) -> str:
    """The label selector listing the workload's pods in its namespace."""
    if workload.kind == WorkloadKind.PYTORCH_JOB:
        return f"{PYTORCH_JOB_NAME}={workload.name}"
    if workload.kind in (WorkloadKind.JOB_SET, WorkloadKind.TRAIN_JOB):
        return f"{JOBSET_NAME}={workload.name}"
    if workload.pod_selector is None:
        raise WorkloadError("a workload of kind Pods needs podSelector")
    return render_selector(workload.pod_selector)


def render_selector(selector: LabelSelector) -> str:
    """``selector`` in the API server's string syntax, sorted by key like ``kubectl`` does."""
    parts = [(key, f"{key}={value}") for key, value in selector.match_labels.items()]
    parts += [(req.key, _render_requirement(req)) for req in selector.match_expressions]
    return ",".join(text for _, text in sorted(parts))


def _render_requirement(req: LabelSelectorRequirement) -> str:
    values = ",".join(sorted(set(req.values)))
    if req.operator == "In":
        return f"{req.key} in ({values})"
    if req.operator == "NotIn":
        return f"{req.key} notin ({values})"
    if req.operator == "Exists":
        return req.key
    return f"!{req.key}"


_SET_TERM: Final = re.compile(r"^\s*(\S+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def parse_selector(text: str) -> LabelSelector | None:
    """A selector in the API server's string syntax (what :func:`render_selector` writes, and
    ``k==v``, ``k!=v``); None for the empty selector, which selects everything.

    Raises:
        ValueError: ``text`` is not a selector.
    """
    labels: dict[str, str] = {}
    requirements: list[LabelSelectorRequirement] = []
    # Commas separate terms, except inside the parentheses of a set.
    for term in re.findall(r"(?:[^,(]|\([^)]*\))+", text):
        if not term.strip():
            continue
        found = _SET_TERM.match(term)
        if found is not None:
            key, op, values = found.groups()
            listed = [v.strip() for v in values.split(",") if v.strip()]
            operator = "In" if op == "in" else "NotIn"
            requirements.append(LabelSelectorRequirement(key=key, operator=operator, values=listed))
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            requirements.append(LabelSelectorRequirement(key=key, operator="NotIn", values=[value]))
        elif "=" in term:
            key, value = (s.strip() for s in term.split("=", 1))
            labels[key] = value.removeprefix("=").strip()
        elif term.strip().startswith("!"):
            key = term.strip()[1:].strip()
            requirements.append(LabelSelectorRequirement(key=key, operator="DoesNotExist"))
        else:
            requirements.append(LabelSelectorRequirement(key=term.strip(), operator="Exists"))
    if not labels and not requirements:
        if text.strip():
            raise ValueError(f"not a label selector: {text!r}")
        return None
    return LabelSelector(match_labels=labels, match_expressions=requirements)


def matches(selector: LabelSelector, labels: Mapping[str, str]) -> bool:
    """Whether a pod with ``labels`` is selected, with the API server's semantics."""
    if any(labels.get(key) != value for key, value in selector.match_labels.items()):
        return False
    return all(_satisfies(req, labels) for req in selector.match_expressions)


def _satisfies(req: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    if req.operator == "In":
        return req.key in labels and labels[req.key] in req.values
    if req.operator == "NotIn":
        # A pod without the label is "not in" any set, as in Kubernetes.
        return labels.get(req.key) not in req.values
    if req.operator == "Exists":
        return req.key in labels
    return req.key not in labels


# -- pod fields ------------------------------------------------------------------------------------


def _name(pod: Pod) -> str:
    name = get_path(pod, "metadata", "name")
    return name if isinstance(name, str) and name else "<unnamed pod>"


def _label_or_annotation(pod: Pod, key: str) -> Any:
    # JobSet and indexed Jobs write their indexes as annotations, and also as labels in
    # recent versions: take whichever is there.
    value = labels_of(pod).get(key)
    return value if value is not None else get_path(pod, "metadata", "annotations", key)


def _container_name(container: Mapping[str, Any]) -> str:
    name = container.get("name")
    return name if isinstance(name, str) else "<unnamed>"


def _node(pod: Pod) -> str | None:
    node = get_path(pod, "spec", "nodeName")
    return node if isinstance(node, str) and node else None


def _phase(pod: Pod) -> str | None:
    phase = get_path(pod, "status", "phase")
    return phase if isinstance(phase, str) else None


def _gpu_container(pod: Pod) -> str | None:
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
        return _container_name(requesting[0])
    if requesting:
        return None
    training = training_container(pod)
    return None if training is None else _container_name(training)


def _uid(pod: Pod) -> str | None:
    uid = get_path(pod, "metadata", "uid")
    return uid if isinstance(uid, str) and uid else None


def _env_entry(container: Mapping[str, Any], variable: str) -> Mapping[str, Any] | None:
    env = container.get("env")
    if not isinstance(env, list):
        return None
    return next(
        (e for e in env if isinstance(e, Mapping) and e.get("name") == variable),
        None,
    )


def _env_value(pod: Pod, container: Mapping[str, Any] | None, variable: str) -> str | None:
    """The variable's value when it can be known from the pod: a literal, or a downward-API
    reference to one of the pod's labels or annotations (how indexed Jobs pass
    ``JOB_COMPLETION_INDEX``). ``None`` when unset or taken from elsewhere."""
    entry = None if container is None else _env_entry(container, variable)
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


def _parse_index(value: object, pod: str, source: str, fix: str) -> int:
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
                total += _parse_index(
                    value,
                    _name(pod),
                    f"{section} {GPU_RESOURCE} of container {_container_name(container)}",
                    "request whole GPUs",
                )
                break
    return total


# -- node ranks ------------------------------------------------------------------------------------


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
    name = _name(pod)
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
    name = _name(pod)
    index = _parse_index(
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
        value = _env_value(pod, container, variable)
        if value is not None:
            fix = "it must be the pod's node rank"
            found.append((variable, _parse_index(value, _name(pod), f"variable {variable}", fix)))
    if len({rank for _, rank in found}) > 1:
        listed = ", ".join(f"{variable} {rank}" for variable, rank in found)
        raise WorkloadError(f"pod {_name(pod)} has conflicting node ranks: {listed}")
    return found[0] if found else None


def _replicated_job(pod: Pod) -> str:
    return str(_label_or_annotation(pod, JOBSET_REPLICATED_JOB) or "")


def _completion_index(pod: Pod) -> int:
    return _parse_index(
        _label_or_annotation(pod, COMPLETION_INDEX),
        _name(pod),
        f"{COMPLETION_INDEX} label or annotation",
        "the JobSet's jobs must use completionMode Indexed",
    )


def _jobset_node_rank(pod: Pod, group: Sequence[Pod]) -> int:
    job_index = _parse_index(
        _label_or_annotation(pod, JOBSET_JOB_INDEX),
        _name(pod),
        f"{JOBSET_JOB_INDEX} label or annotation",
        "is it a pod of a JobSet?",
    )
    replicated = _replicated_job(pod)
    pods_per_job = len({_completion_index(p) for p in group if _replicated_job(p) == replicated})
    return job_index * pods_per_job + _completion_index(pod)


def _pods_node_rank(pod: Pod, mapping: RankMapping) -> int:
    name = _name(pod)
    if mapping.node_rank_label is not None:
        return _parse_index(
            labels_of(pod).get(mapping.node_rank_label),
            name,
            f"label {mapping.node_rank_label}",
            "label every training pod with its node rank, or unset rankMapping.nodeRankLabel",
        )
    variable = mapping.node_rank_env
    holder = next((c for c in containers_of(pod) if _env_entry(c, variable) is not None), None)
    value = _env_value(pod, holder, variable)
    if holder is not None and value is not None:
        return _parse_index(
            value,
            name,
            f"variable {variable} of container {_container_name(holder)}",
            "it must be the pod's node rank",
        )
    return _parse_index(
        _label_or_annotation(pod, COMPLETION_INDEX),
        name,
        f"{variable} variable with a literal value nor a {COMPLETION_INDEX} label or annotation",
        "set rankMapping.nodeRankLabel or rankMapping.nodeRankEnv to where each pod's node rank is",
    )


# -- resolution ------------------------------------------------------------------------------------


def resolve_ranks(
    pods: Sequence[Pod],
    workload: Workload,
    parallelism: Parallelism,
    mapping: RankMapping,
) -> Resolution:
    """Every training rank's pod, node and GPU, or what the workload still waits for."""
    # Pods being deleted are replaced (e.g. a JobSet restart); their node ranks repeat.
    live = [p for p in pods if get_path(p, "metadata", "deletionTimestamp") is None]
    training, waiting = _training_pods(live, workload, mapping)
    if waiting is not None:
        return Resolution(waiting=waiting)
    if not training:
        return Resolution(waiting=f"no pod matches {pod_selector(workload)} yet")

    per_pod = _gpus_per_pod(training, mapping)
    asked = (
        f"dp {parallelism.data_parallel} x pp {parallelism.pipeline_stages} x "
        f"tp {parallelism.tensor_parallel} = {parallelism.world_size}"
    )
    if parallelism.world_size % per_pod:
        raise WorkloadError(
            f"parallelism asks for {asked} processes, not a multiple of the {per_pod} GPUs "
            "per pod; fix spec.parallelism or rankMapping.gpusPerPod"
        )
    expected = parallelism.world_size // per_pod
    declared = _fixed_node_count(training)
    if declared is not None and declared != expected:
        raise WorkloadError(
            f"{_size_mismatch(declared, per_pod, asked)}; the pods set {NNODES_ENV}={declared}"
        )
    if len(training) > expected:
        raise WorkloadError(_size_mismatch(len(training), per_pod, asked))
    if len(training) < expected:
        return Resolution(
            waiting=f"found {len(training)} of {expected} pods ({pod_selector(workload)})"
        )

    ranked = _node_ranks(training, workload, mapping, expected)
    unscheduled = [_name(p) for p in ranked.values() if _node(p) is None]
    if unscheduled:
        return Resolution(
            waiting=f"{len(unscheduled)} of {expected} pods are not scheduled yet: "
            f"{listed(unscheduled, _LISTED_NAMES)}"
        )
    return Resolution(ranks=_placements(ranked, per_pod, parallelism, mapping.order))


def _size_mismatch(pods: int, per_pod: int, asked: str) -> str:
    return (
        f"the workload runs {pods * per_pod} processes ({pods} pods x {per_pod} GPUs) but "
        f"parallelism asks for {asked}"
    )


def _training_pods(
    pods: Sequence[Pod], workload: Workload, mapping: RankMapping
) -> tuple[list[Pod], str | None]:
    """The pods running training processes, or why they cannot be told yet.

    A JobSet (and a TrainJob's) may also run initializers or a launcher: the replicated job
    that requests GPUs is the training one.
    """
    if workload.kind not in (WorkloadKind.JOB_SET, WorkloadKind.TRAIN_JOB):
        return list(pods), None
    jobs: dict[str, list[Pod]] = defaultdict(list)
    for pod in pods:
        jobs[_replicated_job(pod)].append(pod)
    gpu_jobs = sorted(job for job, members in jobs.items() if any(map(gpus_of, members)))
    if len(gpu_jobs) > 1:
        raise WorkloadError(
            f"replicated jobs {', '.join(gpu_jobs)} all request {GPU_RESOURCE}; Perseus "
            "ranks the pods of one replicated job"
        )
    if gpu_jobs:
        return jobs[gpu_jobs[0]], None
    if pods and mapping.gpus_per_pod is None:
        # Initializers run (and finish) before the training pods are even created.
        names = sorted(map(_name, pods))
        return [], (
            f"no pod requests {GPU_RESOURCE} yet (found {len(names)}: "
            f"{listed(names, _LISTED_NAMES)}); "
            "set rankMapping.gpusPerPod if the training pods get GPUs another way"
        )
    if len(jobs) > 1:
        raise WorkloadError(
            f"no pod of replicated jobs {', '.join(sorted(jobs))} requests {GPU_RESOURCE}, "
            "so the training pods cannot be told apart; request GPUs as nvidia.com/gpu"
        )
    return list(pods), None


def _gpus_per_pod(pods: Sequence[Pod], mapping: RankMapping) -> int:
    gpus = {_name(p): gpus_of(p) for p in pods}
    if mapping.gpus_per_pod is not None:
        # Fewer GPUs than processes would put two processes on one GPU; pods without a
        # GPU request get their GPUs another way, which is what gpusPerPod is for.
        short = sorted(name for name, count in gpus.items() if 0 < count < mapping.gpus_per_pod)
        if short:
            raise WorkloadError(
                f"pod {short[0]} requests {gpus[short[0]]} {GPU_RESOURCE} but "
                f"rankMapping.gpusPerPod is {mapping.gpus_per_pod}"
            )
        return mapping.gpus_per_pod
    without = sorted(name for name, count in gpus.items() if count == 0)
    if without:
        raise WorkloadError(
            f"pod {without[0]} requests no {GPU_RESOURCE}; set rankMapping.gpusPerPod if the "
            "training pods get their GPUs another way"
        )
    first_with: dict[int, str] = {}
    for name, count in sorted(gpus.items()):
        first_with.setdefault(count, name)
    if len(first_with) > 1:
        listed = ", ".join(f"{count} ({name})" for count, name in sorted(first_with.items()))
        raise WorkloadError(
            f"the pods request different numbers of {GPU_RESOURCE}: {listed}; every training "
            "pod must run as many processes"
        )
    return next(iter(first_with))


def _fixed_node_count(pods: Sequence[Pod]) -> int | None:
    """The node count the pods give torchrun, when they all agree on a fixed one (an
    elastic ``min:max`` range fixes none). Never an error: resolving ranks only uses it to
    tell a short workload from one still starting (``policies._stated_node_count``, which
    infers the parallelism, says instead why the pods' statements cannot be used)."""
    counts = set()
    for pod in pods:
        value = _env_value(pod, training_container(pod), NNODES_ENV)
        if value is not None and INTEGER.fullmatch(value.strip()):
            counts.add(int(value))
    return counts.pop() if len(counts) == 1 else None


def _node_ranks(
    pods: Sequence[Pod], workload: Workload, mapping: RankMapping, expected: int
) -> dict[int, Pod]:
    """The pods by node rank, which must be exactly 0..expected-1."""
    by_rank: dict[int, list[Pod]] = defaultdict(list)
    for pod in pods:
        by_rank[node_rank(pod, workload, mapping, pods)].append(pod)
    for rank, holders in sorted(by_rank.items()):
        if len(holders) > 1:
            names = sorted(map(_name, holders))
            raise WorkloadError(
                f"pods {listed(names, _LISTED_NAMES)} all have node rank {rank}; every training "
                "pod needs its own node rank"
            )
    stray = sorted(rank for rank in by_rank if rank >= expected)
    if stray:
        missing = sorted(set(range(expected)) - by_rank.keys())
        raise WorkloadError(
            f"pod {_name(by_rank[stray[0]][0])} has node rank {stray[0]} but the workload's "
            f"{expected} pods must have node ranks 0..{expected - 1} (missing "
            f"{', '.join(map(str, missing))})"
        )
    return {rank: holders[0] for rank, holders in sorted(by_rank.items())}


def _coordinates(rank: int, parallelism: Parallelism, order: RankOrder) -> tuple[int, int, int]:
    """(dp, pp, tp) of a global rank."""
    tp, rest = rank % parallelism.tensor_parallel, rank // parallelism.tensor_parallel
    if order == RankOrder.TP_DP_PP:
        return rest % parallelism.data_parallel, rest // parallelism.data_parallel, tp
    return rest // parallelism.pipeline_stages, rest % parallelism.pipeline_stages, tp


def _placements(
    ranked: Mapping[int, Pod], per_pod: int, parallelism: Parallelism, order: RankOrder
) -> tuple[RankPlacement, ...]:
    placements = []
    for node_rank_, pod in ranked.items():
        for local in range(per_pod):
            rank = node_rank_ * per_pod + local
            dp, pp, tp = _coordinates(rank, parallelism, order)
            placements.append(
                RankPlacement(
                    rank=rank,
                    dp_rank=dp,
                    pp_rank=pp,
                    tp_rank=tp,
                    pod=_name(pod),
                    node=str(_node(pod)),
                    local_rank=local,
                    container=_gpu_container(pod),
                    pod_uid=_uid(pod),
                )
            )
    return tuple(placements)


def nodes_of(resolution: Resolution) -> dict[str, list[RankPlacement]]:
    """The placements of each node (one node plan each), nodes sorted by name."""
    grouped: dict[str, list[RankPlacement]] = defaultdict(list)
    for placement in resolution.ranks:
        grouped[placement.node].append(placement)
    return dict(sorted(grouped.items()))


# -- completion ------------------------------------------------------------------------------------


def workload_finished(pods: Sequence[Pod]) -> bool:
    """Whether every pod of the workload has succeeded (and there is at least one)."""
    return bool(pods) and all(_phase(p) == "Succeeded" for p in pods)


# Status conditions that say a workload object ended: (succeeded, failed) condition types.
_END_CONDITIONS: Final = {
    WorkloadKind.PYTORCH_JOB: ("Succeeded", "Failed"),  # Kubeflow training operator v1
    WorkloadKind.JOB_SET: ("Completed", "Failed"),
    WorkloadKind.TRAIN_JOB: ("Complete", "Failed"),  # Kubeflow Trainer v2
}


@dataclass(frozen=True)
class WorkloadEnd:
    """How a workload object says it ended: ``failure`` is None when it succeeded."""

    failure: str | None


def workload_end(kind: WorkloadKind, workload: Mapping[str, Any]) -> WorkloadEnd | None:
    """How the workload ended by its own status conditions, or None while it runs (or for
    kind Pods, which has no object). Its pods may be gone by then (``cleanPodPolicy``, a TTL),
    so this is read before them."""
    types = _END_CONDITIONS.get(kind)
    conditions = get_path(workload, "status", "conditions")
    if types is None or not isinstance(conditions, list):
        return None
    succeeded, failed = types
    for condition in conditions:
        if not isinstance(condition, Mapping) or condition.get("status") != "True":
            continue
        if condition.get("type") == failed:
            why = ": ".join(
                str(part) for part in (condition.get("reason"), condition.get("message")) if part
            )
            name = get_path(workload, "metadata", "name") or "?"
            return WorkloadEnd(f"{kind.value} {name} failed" + (f" ({why})" if why else ""))
        if condition.get("type") == succeeded:
            return WorkloadEnd(None)
    return None


def workload_failed(pods: Sequence[Pod]) -> str | None:
    """Which pods failed and why, or ``None`` when none has."""
    failed = sorted((_name(p), _failure(p)) for p in pods if _phase(p) == "Failed")
    if not failed:
        return None
    names = listed([f"{name} ({why})" if why else name for name, why in failed], _LISTED_NAMES)
    return f"pod {names} failed" if len(failed) == 1 else f"{len(failed)} pods failed: {names}"


def _failure(pod: Pod) -> str:
    """The pod's own reason (e.g. Evicted), else its first container that exited badly."""
    reason, message = get_path(pod, "status", "reason"), get_path(pod, "status", "message")
    if reason:
        return f"{reason}: {message}" if message else str(reason)
    statuses = get_path(pod, "status", "containerStatuses")
    for status in statuses if isinstance(statuses, list) else []:
        terminated = get_path(status, "state", "terminated")
        code = get_path(terminated, "exitCode")
        if code not in (None, 0):
            why = get_path(terminated, "reason")
            return f"{why}, exit code {code}" if why else f"exit code {code}"
    return ""
