"""Which ``PerseusPolicy`` manages which workload, and the ``PerseusJob`` it creates for it.

Pure functions: Kubernetes objects in as plain dicts (as ``kubectl get -o json`` shows them),
parsed policies (:class:`~perseus_api.policy.PerseusPolicySpec`, by name), dataclasses or
dicts out; nothing here reads or writes the cluster.

**Workloads.** A workload is a PyTorchJob, JobSet or TrainJob object, or a group of labelled
pods (kind Pods). Pods are grouped by their controlling owner (an indexed Job, a StatefulSet,
a LeaderWorkerSet...) with :func:`group_pods`, which describes each group as a dict of kind
``Pods`` that the functions here take like any workload: its labels and annotations are the
ones all its pods share, its owner is the pods' controller. Pods without a controller are no
workload (nothing could own their PerseusJob); pods of a PyTorchJob or JobSet are managed as
that workload, and a JobSet that a TrainJob controls as the TrainJob.

**Precedence** (:func:`choose_policy`), first rule that decides:

1. A workload annotated ``perseus.energy/opt-out: "true"`` (kind Pods: any of its pods) is
   managed by no policy.
2. A workload that a user's own PerseusJob already targets (one without the
   ``perseus.energy/policy`` label; :func:`user_job_for` finds it) is managed by no policy:
   the user's job wins.
3. Among the policies that select the workload (:func:`policy_matches`), the most specific
   one manages it:

   a. a policy that selects it by workload labels (``workloads[].labelSelector``) beats one
      that selects it by kind only;
   b. then more selector requirements win: the ``matchLabels`` entries plus the
      ``matchExpressions`` of the policy's ``namespaceSelector`` and of the workload entry
      that selected the workload;
   c. then the higher ``spec.priority``;
   d. then the first policy name in lexicographic order, so the choice is deterministic.

   When one policy selects the workload through several entries, its most specific entry
   counts. The :class:`PolicyChoice` names the winner and, for an event, the others that matched.

**Parallelism** (:func:`infer_parallelism`) is read, never guessed: pipeline stages and
microbatches come from the workload's annotations (``perseus.energy/pipeline-stages``...) or
the training container's ``PERSEUS_*`` variables; the data-parallel degree from the same, else
from the workload's GPUs: world size / (pipeline stages x tensor parallel).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from perseus_api.errors import validation_summary
from perseus_api.job import (
    JOB_KIND,
    LabelSelector,
    Parallelism,
    WorkloadKind,
)
from perseus_api.plan import API_VERSION
from perseus_api.policy import (
    DATA_PARALLEL_ANNOTATION,
    DATA_PARALLEL_ENV,
    MANAGED_BY_POLICY_LABEL,
    MICROBATCHES_ANNOTATION,
    MICROBATCHES_ENV,
    OPT_OUT_ANNOTATION,
    OPT_OUT_VALUE,
    PIPELINE_STAGES_ANNOTATION,
    PIPELINE_STAGES_ENV,
    SCHEDULE_ANNOTATION,
    SCHEDULE_ENV,
    TENSOR_PARALLEL_ANNOTATION,
    TENSOR_PARALLEL_ENV,
    PerseusPolicySpec,
    PolicyWorkload,
)
from perseus_api.resources import label_value, object_key, object_name
from perseus_operator.workloads.objects import (
    INTEGER,
    annotations_of,
    as_mapping,
    get_path,
    labels_of,
    string_map,
    training_container,
)
from perseus_operator.workloads.ranks import (
    GPU_RESOURCE,
    JOBSET_NAME,
    NNODES_ENV,
    PYTORCH_JOB_NAME,
    WorkloadError,
    gpus_of,
    matches,
)

__all__ = [
    "MAX_JOB_NAME",
    "PER_POD_LABELS",
    "PodGroup",
    "PolicyChoice",
    "UnreadableParallelismError",
    "choose_policy",
    "controller_of",
    "get_perseus_job",
    "group_pods",
    "infer_parallelism",
    "opted_out",
    "perseus_job_name",
    "policy_matches",
    "user_job_for",
    "workload_kind",
]

Obj = Mapping[str, Any]

MAX_JOB_NAME: Final = 63
"""Longest generated PerseusJob name: a DNS label, so that the names derived from it (the
profile ConfigMap, node plans) stay valid too."""
PER_POD_LABELS: Final = frozenset(
    {
        "batch.kubernetes.io/job-completion-index",
        "statefulset.kubernetes.io/pod-name",
        "apps.kubernetes.io/pod-index",
        "controller-revision-hash",
        "pod-template-hash",
    }
)
"""Labels that differ between the pods of one controller: never part of a group's selector."""

_LISTED: Final = 3


# -- object fields ---------------------------------------------------------------------------------


def _describe(workload: Obj) -> str:
    namespace, name = object_key(workload)
    return f"{workload.get('kind') or 'workload'} {namespace or '?'}/{name or '?'}"


def controller_of(obj: Obj) -> Mapping[str, Any] | None:
    """The owner reference of an object's controller, if it has one."""
    refs = get_path(obj, "metadata", "ownerReferences")
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


# -- what a workload is ----------------------------------------------------------------------------


def workload_kind(workload: Obj) -> WorkloadKind | None:
    """The workload's kind, from its ``kind`` field; ``None`` for any other object (and for a
    JobSet that a TrainJob controls: it is managed as the TrainJob)."""
    try:
        kind = WorkloadKind(str(workload.get("kind")))
    except ValueError:
        return None
    if kind == WorkloadKind.JOB_SET:
        owner = controller_of(workload)
        if owner is not None and owner.get("kind") == WorkloadKind.TRAIN_JOB.value:
            return None
    return kind


def opted_out(workload: Obj) -> bool:
    """Whether the workload carries ``perseus.energy/opt-out: "true"``."""
    value = annotations_of(workload).get(OPT_OUT_ANNOTATION, "")
    return value.strip().lower() == OPT_OUT_VALUE


@dataclass(frozen=True)
class PodGroup:
    """The pods of one controller, and the kind ``Pods`` workload dict that stands for them."""

    workload: dict[str, Any]
    pods: tuple[Obj, ...]


def group_pods(pods: Iterable[Obj]) -> list[PodGroup]:
    """The pods grouped by namespace and controlling owner, sorted by namespace and name.

    Each group's workload dict has ``kind: Pods``; ``metadata.name``, ``namespace`` and
    ``ownerReferences`` of the controller; as ``labels`` those all its pods share (less
    :data:`PER_POD_LABELS`), as ``annotations`` those all its pods share, plus the opt-out
    annotation when any pod has it; and ``spec.podSelector`` matching the shared labels, the
    PerseusJob's selector. Skipped: pods of a PyTorchJob or a JobSet (TrainJob), pods without
    a controller, and groups whose pods share no label (no selector could find them).
    """
    members: dict[tuple[str, str], list[Obj]] = {}
    owners: dict[tuple[str, str], Mapping[str, Any]] = {}
    for pod in pods:
        labels = labels_of(pod)
        owner = controller_of(pod)
        if PYTORCH_JOB_NAME in labels or JOBSET_NAME in labels or owner is None:
            continue
        namespace, _ = object_key(pod)
        key = (namespace, str(owner.get("uid") or f"{owner.get('kind')}/{owner.get('name')}"))
        members.setdefault(key, []).append(pod)
        owners.setdefault(key, owner)
    groups = []
    for key, group in members.items():
        shared = _shared([labels_of(p) for p in group], exclude=PER_POD_LABELS)
        if not shared:
            continue
        annotations = _shared([annotations_of(p) for p in group])
        if any(opted_out(p) for p in group):
            annotations[OPT_OUT_ANNOTATION] = OPT_OUT_VALUE
        owner = owners[key]
        workload = {
            "apiVersion": "v1",
            "kind": WorkloadKind.PODS.value,
            "metadata": {
                "name": str(owner.get("name") or ""),
                "namespace": key[0],
                "labels": shared,
                "annotations": annotations,
                "ownerReferences": [dict(owner)],
            },
            "spec": {"podSelector": {"matchLabels": dict(shared)}},
        }
        groups.append(PodGroup(workload=workload, pods=tuple(group)))
    return sorted(groups, key=lambda g: object_key(g.workload))


def _shared(
    mappings: Sequence[Mapping[str, str]], exclude: frozenset[str] = frozenset()
) -> dict[str, str]:
    first, *rest = mappings
    return {
        k: v
        for k, v in sorted(first.items())
        if k not in exclude and all(m.get(k) == v for m in rest)
    }


# -- matching and precedence -----------------------------------------------------------------------


def _requirements(selector: LabelSelector | None) -> int:
    if selector is None:
        return 0
    return len(selector.match_labels) + len(selector.match_expressions)


def _entry_rank(entry: PolicyWorkload) -> tuple[bool, int]:
    return entry.label_selector is not None, _requirements(entry.label_selector)


def _matching_entry(
    policy: PerseusPolicySpec, namespace_labels: Mapping[str, str], workload: Obj
) -> PolicyWorkload | None:
    """The policy's most specific workload entry that selects the workload, if any."""
    kind = workload_kind(workload)
    if kind is None or not matches(policy.namespace_selector, string_map(namespace_labels)):
        return None
    labels = labels_of(workload)
    selecting = [
        entry
        for entry in policy.workloads
        if entry.kind == kind
        and (entry.label_selector is None or matches(entry.label_selector, labels))
    ]
    return max(selecting, key=_entry_rank, default=None)


def policy_matches(
    policy: PerseusPolicySpec, namespace_labels: Mapping[str, str], workload: Obj
) -> bool:
    """Whether the policy selects the workload: its ``namespaceSelector`` matches the labels
    of the workload's namespace, and one of its ``workloads`` entries has the workload's kind
    and (when it has a ``labelSelector``) matches the workload's labels. Selectors have the
    API server's semantics (``NotIn`` and ``DoesNotExist`` match an absent label). Opt-out
    and users' own PerseusJobs are not looked at here (:func:`choose_policy` does)."""
    return _matching_entry(policy, namespace_labels, workload) is not None


@dataclass(frozen=True)
class PolicyChoice:
    """The policy that manages a workload, and the other policies that selected it."""

    policy: str
    spec: PerseusPolicySpec
    entry: PolicyWorkload
    """The winner's workload entry that selected the workload."""
    others: tuple[str, ...] = ()
    """The other selecting policies, in precedence order."""

    @property
    def requirements(self) -> int:
        return _requirements(self.spec.namespace_selector) + _requirements(
            self.entry.label_selector
        )

    @property
    def message(self) -> str:
        """What an event on the workload says about the choice."""
        how = "by its labels" if self.entry.label_selector is not None else "by kind only"
        text = (
            f"PerseusPolicy {self.policy} manages this {self.entry.kind.value} (selected "
            f"{how}, {self.requirements} selector requirements, priority {self.spec.priority})"
        )
        if self.others:
            text += (
                f"; also selected by {', '.join(self.others)}, less specific, of lower "
                "priority or later by name"
            )
        return text


def choose_policy(
    policies: Mapping[str, PerseusPolicySpec],
    namespace_labels: Mapping[str, str],
    workload: Obj,
    *,
    claimed_by_user: bool = False,
) -> PolicyChoice | None:
    """The policy that manages the workload, or ``None`` (see the module's precedence rules).

    ``policies``: the valid policies by name. ``namespace_labels``: the labels of the
    workload's namespace. ``claimed_by_user``: a user's own PerseusJob targets the workload
    (:func:`user_job_for`).
    """
    if opted_out(workload) or claimed_by_user:
        return None
    ranked = []
    for name, spec in policies.items():
        entry = _matching_entry(spec, namespace_labels, workload)
        if entry is not None:
            has_labels, entry_requirements = _entry_rank(entry)
            requirements = _requirements(spec.namespace_selector) + entry_requirements
            ranked.append(((-has_labels, -requirements, -spec.priority, name), name, spec, entry))
    if not ranked:
        return None
    ranked.sort(key=lambda item: item[0])
    _, name, spec, entry = ranked[0]
    return PolicyChoice(policy=name, spec=spec, entry=entry, others=tuple(r[1] for r in ranked[1:]))


def user_job_for(jobs: Iterable[Obj], workload: Obj, pods: Iterable[Obj] = ()) -> str | None:
    """The first name (in order) of the PerseusJobs in ``jobs`` that a user wrote (no
    :data:`~perseus_api.policy.MANAGED_BY_POLICY_LABEL`) for the workload, in its namespace:
    one that names the workload's kind and name (a JobSet and a TrainJob of one name are one
    workload), or one of kind Pods whose ``podSelector`` matches the labels a Pods workload's
    pods share, or any of ``pods`` (the workload's pods, when the caller has them)."""
    kind = workload_kind(workload)
    namespace, name = object_key(workload)
    if kind is None:
        return None
    label_sets = [labels_of(p) for p in pods]
    if kind == WorkloadKind.PODS:
        label_sets.append(labels_of(workload))
    claiming = []
    for job in jobs:
        job_namespace, job_name = object_key(job)
        if MANAGED_BY_POLICY_LABEL in labels_of(job) or job_namespace != namespace:
            continue
        target = as_mapping(get_path(job, "spec", "workload"))
        if _targets(target, kind, name, label_sets):
            claiming.append(job_name)
    return min(claiming, default=None)


def _targets(
    target: Mapping[str, Any], kind: WorkloadKind, name: str, label_sets: list[dict[str, str]]
) -> bool:
    target_kind = str(target.get("kind"))
    if target_kind == WorkloadKind.PODS.value:
        try:
            selector = LabelSelector.model_validate(target.get("podSelector"))
        except ValidationError:
            return False  # the user's job is invalid and reports that itself
        return any(matches(selector, labels) for labels in label_sets)
    jobsets = {WorkloadKind.JOB_SET.value, WorkloadKind.TRAIN_JOB.value}
    same_kind = target_kind == kind.value or {target_kind, kind.value} <= jobsets
    return kind != WorkloadKind.PODS and same_kind and target.get("name") == name


# -- parallelism -----------------------------------------------------------------------------------


class _UnknownError(Exception):
    """Parallelism cannot be read; ``reason`` says what is missing and how to state it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnreadableParallelismError(Exception):
    """A workload's parallelism cannot be read: the message says what is missing and which
    annotation to set, after the workload's kind and namespace/name."""


@dataclass(frozen=True)
class _Setting:
    what: str
    annotation: str
    env: str


_STAGES: Final = _Setting("pipeline stages", PIPELINE_STAGES_ANNOTATION, PIPELINE_STAGES_ENV)
_MICROBATCHES: Final = _Setting("microbatches", MICROBATCHES_ANNOTATION, MICROBATCHES_ENV)
_DATA_PARALLEL: Final = _Setting("data parallel", DATA_PARALLEL_ANNOTATION, DATA_PARALLEL_ENV)
_TENSOR_PARALLEL: Final = _Setting(
    "tensor parallel", TENSOR_PARALLEL_ANNOTATION, TENSOR_PARALLEL_ENV
)
_SCHEDULE: Final = _Setting("schedule", SCHEDULE_ANNOTATION, SCHEDULE_ENV)


def infer_parallelism(
    workload: Obj, pods: Sequence[Obj] | None = None, *, gpus_per_pod: int | None = None
) -> Parallelism:
    """The workload's parallelism.

    Each setting is read from an annotation (``perseus.energy/pipeline-stages``,
    ``microbatches``, ``data-parallel``, ``tensor-parallel``, ``schedule``) of the workload,
    of its pod templates or of ``pods``; else from the literal ``PERSEUS_*`` variable of the
    training container (the ``pytorch`` one of a PyTorchJob, else the first) of its pod
    templates (a TrainJob's ``spec.trainer.env``) or of ``pods``. All places that state a
    setting must agree. Pipeline stages and microbatches are required; tensor parallel
    defaults to 1, the schedule to 1F1B; data parallel to the workload's processes /
    (pipeline stages x tensor parallel), one process per GPU:

    * PyTorchJob: the Master and Worker replicas x the GPUs (``nvidia.com/gpu``) each pod
      requests; ``nprocPerNode``, when a number, must equal them.
    * JobSet: of the one replicated job that requests GPUs, replicas x the Job's
      ``parallelism`` (at most ``completions``) x the GPUs each pod requests.
    * TrainJob: ``spec.trainer.numNodes`` (else the pods' ``PET_NNODES``) x the GPUs of
      ``spec.trainer.resourcesPerNode`` (else of the pods).
    * Pods: the pods' ``PET_NNODES`` x the GPUs each pod requests (the pods of a group that
      is still starting do not tell how many there will be).

    ``gpus_per_pod`` (the policy's ``rankMapping.gpusPerPod``) replaces the GPUs requested.
    When data parallel is stated and the processes are known too, they must agree.

    Raises:
        UnreadableParallelismError: why it cannot be read (what is missing and which
            annotation to set), prefixed with the workload's kind and namespace/name.
    """
    kind = workload_kind(workload)
    if kind is None:
        raise UnreadableParallelismError(
            f"{_describe(workload)}: not a PyTorchJob, JobSet, TrainJob or group of Pods"
        )
    try:
        return _infer(kind, workload, tuple(pods or ()), gpus_per_pod)
    except _UnknownError as exc:
        raise UnreadableParallelismError(f"{_describe(workload)}: {exc.reason}") from None


def _infer(
    kind: WorkloadKind, workload: Obj, pods: tuple[Obj, ...], gpus_per_pod: int | None
) -> Parallelism:
    sources = _Sources(kind, workload, pods)
    stages = sources.positive(_STAGES)
    microbatches = sources.positive(_MICROBATCHES)
    if stages is None:
        raise _UnknownError(sources.missing(_STAGES, "Perseus never guesses the pipeline layout"))
    if microbatches is None:
        raise _UnknownError(
            sources.missing(_MICROBATCHES, "microbatches per iteration and replica")
        )
    tensor = sources.positive(_TENSOR_PARALLEL) or 1
    schedule = sources.read(_SCHEDULE)
    data = sources.positive(_DATA_PARALLEL)
    try:
        world: tuple[int, str] | None = _world_size(kind, workload, pods, gpus_per_pod)
        unknown_world = ""
    except _UnknownError as exc:
        world, unknown_world = None, exc.reason
    per_replica = stages * tensor
    if data is None:
        if world is None:
            raise _UnknownError(
                f"{unknown_world}; or annotate {DATA_PARALLEL_ANNOTATION} (data-parallel replicas)"
            )
        processes, how = world
        if processes % per_replica:
            raise _UnknownError(
                f"the workload runs {processes} processes ({how}), not a multiple of "
                f"{stages} pipeline stages x {tensor} tensor parallel = {per_replica}; fix "
                f"{PIPELINE_STAGES_ANNOTATION} or {TENSOR_PARALLEL_ANNOTATION}"
            )
        data = processes // per_replica
    elif world is not None and world[0] != data * per_replica:
        raise _UnknownError(
            f"data parallel {data} x {stages} pipeline stages x {tensor} tensor parallel = "
            f"{data * per_replica} processes, but the workload runs {world[0]} ({world[1]}); "
            f"fix {DATA_PARALLEL_ANNOTATION}"
        )
    fields: dict[str, Any] = {
        "pipelineStages": stages,
        "microbatches": microbatches,
        "dataParallel": data,
        "tensorParallel": tensor,
    }
    if schedule is not None:
        fields["schedule"] = schedule[0]
    try:
        return Parallelism.model_validate(fields)
    except ValidationError as exc:
        raise _UnknownError(f"invalid parallelism: {validation_summary(exc)}") from None


class _Sources:
    """Where a workload states its settings: annotations first, then container variables."""

    def __init__(self, kind: WorkloadKind, workload: Obj, pods: tuple[Obj, ...]) -> None:
        self.kind = kind
        templates = _pod_templates(kind, workload)
        self.annotated = [(f"{kind.value}", annotations_of(workload))]
        self.annotated += [(where, annotations_of(t)) for where, t in templates]
        self.annotated += [(f"pod {_name(p)}", annotations_of(p)) for p in pods]
        self.containers = [(where, training_container(t) or {}) for where, t in templates]
        self.containers += [(f"pod {_name(p)}", training_container(p) or {}) for p in pods]

    def read(self, setting: _Setting) -> tuple[str, str] | None:
        """``(value, where it is stated)``, or None when nowhere."""
        found = [
            (value.strip(), f"annotation {setting.annotation} of {where}")
            for where, annotations in self.annotated
            if (value := annotations.get(setting.annotation)) is not None
        ]
        if not found:
            found = [
                (value.strip(), f"variable {setting.env} of {where}")
                for where, container in self.containers
                if (value := _literal_env(container, setting.env)) is not None
            ]
        if not found:
            return None
        if len({value for value, _ in found}) > 1:
            listed = ", ".join(f"{value!r} ({where})" for value, where in found[:_LISTED])
            raise _UnknownError(f"{setting.what} is stated differently: {listed}")
        return found[0]

    def positive(self, setting: _Setting) -> int | None:
        stated = self.read(setting)
        if stated is None:
            return None
        value, where = stated
        if not INTEGER.fullmatch(value) or int(value) < 1:
            raise _UnknownError(f"{where} is {value!r}, not a positive integer")
        return int(value)

    def missing(self, setting: _Setting, why: str) -> str:
        on = "the pods" if self.kind == WorkloadKind.PODS else f"the {self.kind.value}"
        return (
            f"{setting.what} unknown ({why}): annotate {on} with {setting.annotation}, or "
            f"set {setting.env} on the training container"
        )


def _name(obj: Obj) -> str:
    _, name = object_key(obj)
    return name or "<unnamed>"


def _literal_env(container: Mapping[str, Any], variable: str) -> str | None:
    env = container.get("env")
    for entry in env if isinstance(env, list) else []:
        if isinstance(entry, Mapping) and entry.get("name") == variable:
            value = entry.get("value")
            return None if value is None else str(value)
    return None


def _pod_templates(kind: WorkloadKind, workload: Obj) -> list[tuple[str, Obj]]:
    """The workload's pod templates (where they are, the template)."""
    spec = as_mapping(workload.get("spec"))
    if kind == WorkloadKind.PYTORCH_JOB:
        replicas = as_mapping(spec.get("pytorchReplicaSpecs"))
        return [
            (f"{kind.value} {rtype} template", as_mapping(get_path(r, "template")))
            for rtype, r in sorted(replicas.items())
        ]
    if kind == WorkloadKind.JOB_SET:
        jobs = [_replicated_job(j) for j in _list(spec.get("replicatedJobs"))]
        training = [j for j in jobs if j[2] > 0] or jobs
        return [(f"replicated job {name}", template) for name, template, _, _ in training]
    if kind == WorkloadKind.TRAIN_JOB:
        env = get_path(spec, "trainer", "env")
        return [("spec.trainer", {"spec": {"containers": [{"env": env}]}})] if env else []
    return []


def _list(value: object) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _count(value: object, where: str, default: int = 1) -> int:
    if value is None:
        return default
    text = "" if isinstance(value, bool) else str(value).strip()
    if not isinstance(value, int | str) or not INTEGER.fullmatch(text):
        raise _UnknownError(f"{where} is {value!r}, not a non-negative integer")
    return int(text)


def _gpus(template: Obj, where: str) -> int:
    try:
        return gpus_of(template)
    except WorkloadError as exc:
        raise _UnknownError(f"{where}: {exc}") from None


def _replicated_job(job: Mapping[str, Any]) -> tuple[str, Obj, int, int]:
    """(name, pod template, GPUs per pod, pods) of a JobSet's replicated job."""
    name = str(job.get("name") or "<unnamed>")
    where = f"replicated job {name}"
    job_spec = as_mapping(get_path(job, "template", "spec"))
    template = as_mapping(job_spec.get("template"))
    pods = _count(job_spec.get("parallelism"), f"{where}: parallelism")
    if job_spec.get("completions") is not None:
        pods = min(pods, _count(job_spec.get("completions"), f"{where}: completions"))
    replicas = _count(job.get("replicas"), f"{where}: replicas")
    return name, template, _gpus(template, where), replicas * pods


def _processes_per_pod(gpus: int, nproc: object, where: str, gpus_per_pod: int | None) -> int:
    """Processes each pod runs: one per GPU it requests (or ``gpus_per_pod``)."""
    if gpus_per_pod is not None:
        return gpus_per_pod
    text = "" if nproc is None else str(nproc).strip()
    if INTEGER.fullmatch(text) and gpus and int(text) != gpus:
        raise _UnknownError(
            f"{where} request {gpus} {GPU_RESOURCE} but run {text} processes per pod; "
            "Perseus runs one process per GPU"
        )
    if text and not INTEGER.fullmatch(text) and text.lower() not in ("auto", "gpu"):
        raise _UnknownError(
            f"{where} run {text!r} processes per pod; Perseus runs one process per GPU"
        )
    if not gpus:
        raise _UnknownError(
            f"{where} request no {GPU_RESOURCE}; set rankMapping.gpusPerPod in the "
            "PerseusPolicy if the training pods get their GPUs another way"
        )
    return gpus


def _world_size(
    kind: WorkloadKind, workload: Obj, pods: tuple[Obj, ...], gpus_per_pod: int | None
) -> tuple[int, str]:
    """The training processes, and how they were counted."""
    spec = as_mapping(workload.get("spec"))
    if kind == WorkloadKind.PYTORCH_JOB:
        return _pytorch_world(spec, gpus_per_pod)
    if kind == WorkloadKind.JOB_SET:
        return _jobset_world(spec, gpus_per_pod)
    if kind == WorkloadKind.TRAIN_JOB:
        return _trainjob_world(spec, pods, gpus_per_pod)
    return _pods_world(pods, gpus_per_pod)


def _pytorch_world(spec: Mapping[str, Any], gpus_per_pod: int | None) -> tuple[int, str]:
    replica_specs = as_mapping(spec.get("pytorchReplicaSpecs"))
    if not replica_specs:
        raise _UnknownError("spec.pytorchReplicaSpecs is missing")
    elastic = as_mapping(spec.get("elasticPolicy"))
    least, most = elastic.get("minReplicas"), elastic.get("maxReplicas")
    if least is not None and most is not None and least != most:
        raise _UnknownError(
            f"elastic between {least} and {most} replicas, so the processes are not fixed"
        )
    nproc = spec.get("nprocPerNode", elastic.get("nProcPerNode"))
    pods, per_pod = 0, dict[str, int]()
    for rtype, replica in sorted(replica_specs.items()):
        where = f"{rtype} replicas"
        if str(rtype).lower() not in ("master", "worker"):
            raise _UnknownError(f"replica type {rtype}: Perseus ranks Master and Worker replicas")
        count = _count(get_path(replica, "replicas"), f"spec.pytorchReplicaSpecs.{rtype}.replicas")
        if count:
            template = as_mapping(get_path(replica, "template"))
            per_pod[rtype] = _processes_per_pod(_gpus(template, where), nproc, where, gpus_per_pod)
            pods += count
    if len(set(per_pod.values())) > 1:
        listed = ", ".join(f"{rtype} {n}" for rtype, n in per_pod.items())
        raise _UnknownError(
            f"the replicas run different numbers of processes per pod ({listed}); every "
            "training pod must run as many"
        )
    if not pods:
        raise _UnknownError("no Master or Worker replicas")
    (processes,) = set(per_pod.values())
    return pods * processes, f"{pods} pods x {processes} GPUs"


def _jobset_world(spec: Mapping[str, Any], gpus_per_pod: int | None) -> tuple[int, str]:
    jobs = [_replicated_job(j) for j in _list(spec.get("replicatedJobs"))]
    if not jobs:
        raise _UnknownError("spec.replicatedJobs is missing")
    training = [j for j in jobs if j[2] > 0]
    if len(training) > 1:
        names = ", ".join(name for name, _, _, _ in training)
        raise _UnknownError(
            f"replicated jobs {names} all request {GPU_RESOURCE}; Perseus ranks the pods of "
            "one replicated job"
        )
    if not training:
        if gpus_per_pod is None or len(jobs) > 1:
            raise _UnknownError(
                f"no replicated job requests {GPU_RESOURCE}; request GPUs as {GPU_RESOURCE} "
                "(or, with one replicated job, set rankMapping.gpusPerPod in the PerseusPolicy)"
            )
        training = jobs
    name, _, gpus, pods = training[0]
    per_pod = _processes_per_pod(gpus, None, f"pods of replicated job {name}", gpus_per_pod)
    if not pods:
        raise _UnknownError(f"replicated job {name} runs no pods")
    return pods * per_pod, f"{pods} pods x {per_pod} GPUs"


def _stated_node_count(pods: Sequence[Obj]) -> int | None:
    """The node count the pods' training containers state (``PET_NNODES``, literally), ``None``
    when none does; an error saying why when they disagree or state no fixed number."""
    stated = {
        value.strip()
        for p in pods
        if (value := _literal_env(training_container(p) or {}, NNODES_ENV)) is not None
    }
    if len(stated) > 1:
        raise _UnknownError(f"the pods state different {NNODES_ENV}: {', '.join(sorted(stated))}")
    if not stated:
        return None
    (text,) = stated
    if not INTEGER.fullmatch(text) or int(text) < 1:
        raise _UnknownError(f"the pods' {NNODES_ENV} is {text!r}, not a fixed number of nodes")
    return int(text)


def _pods_gpus(pods: Sequence[Obj]) -> int:
    """The GPUs each training pod requests (pods without GPUs are not training pods)."""
    counts = {n for p in pods if (n := _gpus(p, f"pod {_name(p)}"))}
    if len(counts) > 1:
        listed = ", ".join(map(str, sorted(counts)))
        raise _UnknownError(f"the pods request different numbers of {GPU_RESOURCE}: {listed}")
    return counts.pop() if counts else 0


def _trainjob_world(
    spec: Mapping[str, Any], pods: tuple[Obj, ...], gpus_per_pod: int | None
) -> tuple[int, str]:
    trainer = as_mapping(spec.get("trainer"))
    nodes = _count(trainer.get("numNodes"), "spec.trainer.numNodes", default=0)
    if not nodes:
        nodes = _stated_node_count(pods) or 0
    if not nodes:
        raise _UnknownError(
            "spec.trainer.numNodes is unset (its runtime decides) and no pod states "
            f"{NNODES_ENV} yet"
        )
    resources = as_mapping(trainer.get("resourcesPerNode"))
    where = "spec.trainer.resourcesPerNode"
    gpus = _gpus({"spec": {"containers": [{"resources": resources}]}}, where)
    if not gpus and pods:
        where, gpus = "the pods", _pods_gpus(pods)
    per_pod = _processes_per_pod(gpus, trainer.get("numProcPerNode"), where, gpus_per_pod)
    return nodes * per_pod, f"{nodes} nodes x {per_pod} GPUs"


def _pods_world(pods: tuple[Obj, ...], gpus_per_pod: int | None) -> tuple[int, str]:
    if not pods:
        raise _UnknownError("no pods")
    nodes = _stated_node_count(pods)
    if nodes is None:
        raise _UnknownError(
            f"how many training pods there will be is not stated: set {NNODES_ENV} on the "
            "training container"
        )
    per_pod = _processes_per_pod(_pods_gpus(pods), None, "the pods", gpus_per_pod)
    return nodes * per_pod, f"{nodes} pods x {per_pod} GPUs"


# -- the PerseusJob --------------------------------------------------------------------------------


def perseus_job_name(workload_name: str) -> str:
    """The PerseusJob's name: the workload's, when it is a DNS-1123 subdomain of at most
    :data:`MAX_JOB_NAME` characters; else a sanitized one with a hash of the whole name
    (:func:`perseus_api.resources.object_name`)."""
    return object_name(workload_name, max_chars=MAX_JOB_NAME)


def get_perseus_job(
    policy_name: str, policy: PerseusPolicySpec, workload: Obj, parallelism: Parallelism
) -> dict[str, Any]:
    """The PerseusJob that ``policy_name`` creates for ``workload``, ready to create.

    In the workload's namespace, named after it (:func:`perseus_job_name`), labelled with
    :data:`~perseus_api.policy.MANAGED_BY_POLICY_LABEL`, and owned by the workload (for kind
    Pods: by the pods' controller) as its controller, so that it goes when the workload goes;
    ``blockOwnerDeletion`` is false, so that it never holds up the workload's deletion.
    ``spec.policy``, ``profiling``, ``stragglers`` and ``rankMapping`` hold the fields the
    policy sets, and no others: the fields it leaves unset get the defaults they get in a
    hand-written PerseusJob.

    Raises:
        ValueError: ``workload`` is not a workload, or has no name or uid (or controller),
            which an object read from the API server always has.
    """
    kind = workload_kind(workload)
    namespace, name = object_key(workload)
    if kind is None or not name or not namespace:
        raise ValueError(f"{_describe(workload)} is not a named workload in a namespace")
    if kind == WorkloadKind.PODS:
        owner = controller_of(workload)
        if owner is None:
            raise ValueError(f"{_describe(workload)} has no controller to own its PerseusJob")
        target: dict[str, Any] = {
            "kind": kind.value,
            "podSelector": dict(as_mapping(get_path(workload, "spec", "podSelector"))),
        }
    else:
        owner = {
            "apiVersion": workload.get("apiVersion"),
            "kind": workload.get("kind"),
            "name": name,
            "uid": get_path(workload, "metadata", "uid"),
        }
        target = {"kind": kind.value, "name": name}
    if not owner.get("uid") or not owner.get("apiVersion"):
        raise ValueError(f"{_describe(workload)}: its owner has no apiVersion or uid")

    def section(model: BaseModel) -> dict[str, Any]:
        return model.model_dump(mode="json", by_alias=True, exclude_unset=True)

    return {
        "apiVersion": API_VERSION,
        "kind": JOB_KIND,
        "metadata": {
            "name": perseus_job_name(name),
            "namespace": namespace,
            "labels": {MANAGED_BY_POLICY_LABEL: label_value(policy_name)},
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": owner["kind"],
                    "name": owner["name"],
                    "uid": owner["uid"],
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {
            "workload": target,
            "parallelism": parallelism.model_dump(mode="json", by_alias=True),
            "rankMapping": section(policy.rank_mapping),
            "policy": section(policy.policy),
            "profiling": section(policy.profiling),
            "stragglers": section(policy.stragglers),
        },
    }
