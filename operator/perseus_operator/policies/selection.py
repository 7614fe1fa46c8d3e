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

How many pipeline stages, microbatches and replicas the workload runs, which the PerseusJob
needs too, :mod:`perseus_operator.policies.parallelism` reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from perseus_api.job import JOB_KIND, LabelSelector, Parallelism, WorkloadKind
from perseus_api.plan import API_VERSION
from perseus_api.policy import (
    MANAGED_BY_POLICY_LABEL,
    OPT_OUT_ANNOTATION,
    OPT_OUT_VALUE,
    PerseusPolicySpec,
    PolicyWorkload,
)
from perseus_api.resources import label_value, object_key, object_name
from perseus_operator.workloads.objects import (
    annotations_of,
    as_mapping,
    get_path,
    labels_of,
    string_map,
)
from perseus_operator.workloads.pods import JOBSET_NAME, PYTORCH_JOB_NAME
from perseus_operator.workloads.selectors import matches

__all__ = [
    "MAX_JOB_NAME",
    "PER_POD_LABELS",
    "PodGroup",
    "PolicyChoice",
    "choose_policy",
    "controller_of",
    "describe_workload",
    "get_perseus_job",
    "group_pods",
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


def describe_workload(workload: Obj) -> str:
    """``<kind> <namespace>/<name>``, for messages."""
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
        raise ValueError(f"{describe_workload(workload)} is not a named workload in a namespace")
    if kind == WorkloadKind.PODS:
        owner = controller_of(workload)
        if owner is None:
            raise ValueError(
                f"{describe_workload(workload)} has no controller to own its PerseusJob"
            )
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
        raise ValueError(f"{describe_workload(workload)}: its owner has no apiVersion or uid")

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
