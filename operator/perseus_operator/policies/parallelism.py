"""How a workload's parallelism is read: pipeline stages, microbatches, replicas.

Pure, like :mod:`perseus_operator.policies.selection` (whose workloads it reads): the
PerseusJob a policy creates needs the workload's (pp, dp, tp) layout.

**Parallelism** (:func:`infer_parallelism`) is read, never guessed: pipeline stages and
microbatches come from the workload's annotations (``perseus.energy/pipeline-stages``...) or
the training container's ``PERSEUS_*`` variables; the data-parallel degree from the same, else
from the workload's GPUs: world size / (pipeline stages x tensor parallel).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from perseus_api.errors import validation_summary
from perseus_api.job import Parallelism, WorkloadKind
from perseus_api.policy import (
    DATA_PARALLEL_ANNOTATION,
    DATA_PARALLEL_ENV,
    MICROBATCHES_ANNOTATION,
    MICROBATCHES_ENV,
    PIPELINE_STAGES_ANNOTATION,
    PIPELINE_STAGES_ENV,
    SCHEDULE_ANNOTATION,
    SCHEDULE_ENV,
    TENSOR_PARALLEL_ANNOTATION,
    TENSOR_PARALLEL_ENV,
)
from perseus_api.resources import object_key
from perseus_operator.policies.selection import describe_workload, workload_kind
from perseus_operator.workloads.objects import (
    INTEGER,
    annotations_of,
    as_mapping,
    get_path,
    training_container,
)
from perseus_operator.workloads.pods import GPU_RESOURCE, NNODES_ENV, WorkloadError, gpus_of

__all__ = ["UnreadableParallelismError", "infer_parallelism"]

Obj = Mapping[str, Any]

_LISTED: Final = 3


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
            f"{describe_workload(workload)}: not a PyTorchJob, JobSet, TrainJob or group of Pods"
        )
    try:
        return _infer(kind, workload, tuple(pods or ()), gpus_per_pod)
    except _UnknownError as exc:
        raise UnreadableParallelismError(f"{describe_workload(workload)}: {exc.reason}") from None


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
