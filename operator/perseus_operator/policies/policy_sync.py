"""One round of the cluster-wide policies: what to create, change and delete so that every
workload a ``PerseusPolicy`` manages has its ``PerseusJob``, and what each policy's status says.

Pure: :func:`get_sync_plan` takes a :class:`ClusterView` (objects as the API server returns
them) and returns a :class:`SyncPlan`; :mod:`perseus_operator.policies.policy_controller` reads the
view and carries the plan out. Which policy manages a workload, and the job it creates, are
:mod:`perseus_operator.policies.selection`' rules, what each policy's status then says
:mod:`perseus_operator.policies.policy_status`'; here is what happens to the jobs over time:

- A job a policy made carries the label ``perseus.energy/policy`` and belongs to the workload
  that controls it (owner reference, by uid). A job without that label is a user's and is
  never touched.
- **Create** when the winning policy's job does not exist yet and the parallelism can be
  read; when it cannot, a warning event on the workload says what to state.
- **Update** (spec sections and label, as a merge patch) when the policy, the winner or the
  parallelism changed: the job's :data:`SPEC_HASH_ANNOTATION` is the hash of what the policy
  asked for, so defaults the API server filled in never look like a change.
- **Delete** when the workload is gone, opted out, taken over by the user's own PerseusJob,
  or selected by no valid policy any more (the job's finalizer still resets its GPUs).
  A job whose parallelism can no longer be read is kept: it was readable once, and a job is
  never deleted for what may be a passing state.
- A job being deleted (``deletionTimestamp`` set, its finalizer resetting the GPUs) is left
  alone: one DELETE, never repeated, never patched; a new one is made once it is gone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from perseus_api.job import Parallelism, WorkloadKind
from perseus_api.policy import MANAGED_BY_POLICY_LABEL, PerseusPolicySpec, PolicyError, parse_policy
from perseus_api.resources import GROUP, label_value, object_key
from perseus_operator.policies.parallelism import UnreadableParallelismError, infer_parallelism
from perseus_operator.policies.policy_status import get_policy_status
from perseus_operator.policies.selection import (
    PodGroup,
    PolicyChoice,
    choose_policy,
    controller_of,
    get_perseus_job,
    group_pods,
    opted_out,
    user_job_for,
    workload_kind,
)
from perseus_operator.workloads.objects import annotations_of, labels_of, terminating
from perseus_operator.workloads.pods import JOBSET_NAME, PYTORCH_JOB_NAME
from perseus_operator.workloads.selectors import matches

__all__ = [
    "SPEC_HASH_ANNOTATION",
    "ClusterView",
    "JobDeletion",
    "JobUpdate",
    "SyncPlan",
    "WorkloadEvent",
    "get_listing",
    "get_sync_plan",
    "merge_patch",
    "parse_policies",
]

Obj = Mapping[str, Any]

SPEC_HASH_ANNOTATION: Final = f"{GROUP}/policy-spec-hash"
"""On a policy-made PerseusJob: hash of the spec the policy asked for (see the module doc)."""
_NAMESPACE_NAME_LABEL: Final = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class ClusterView:
    """What one round looks at.

    Attributes:
        policies: Every PerseusPolicy.
        namespaces: Every namespace the operator may manage (their labels select them).
        workloads: PyTorchJob, JobSet and TrainJob objects of the namespaces in the listing.
        pods: Pods of the namespaces in the listing whose policies select kind Pods.
        jobs: Every PerseusJob of the namespaces in the listing, and every policy-made one
            elsewhere (a namespace no policy selects any more still has them).
    """

    policies: Sequence[Obj] = ()
    namespaces: Sequence[Obj] = ()
    workloads: Sequence[Obj] = ()
    pods: Sequence[Obj] = ()
    jobs: Sequence[Obj] = ()


@dataclass(frozen=True)
class WorkloadEvent:
    """A Kubernetes event about ``involved`` (an object reference with its namespace)."""

    involved: dict[str, str]
    type: Literal["Normal", "Warning"]
    reason: str
    message: str

    @property
    def key(self) -> tuple[str, str, str]:
        """What makes it a repeat: the same object, reason and message."""
        return (self.involved.get("uid", ""), self.reason, self.message)


@dataclass(frozen=True)
class JobUpdate:
    namespace: str
    name: str
    patch: dict[str, Any]
    """JSON merge patch of the job (labels, annotations, spec)."""


@dataclass(frozen=True)
class JobDeletion:
    namespace: str
    name: str
    reason: str


@dataclass(frozen=True)
class SyncPlan:
    """What to do, in order: creates, updates, deletes, events; then the policies' statuses
    (by policy name, camelCase, only those that differ from the stored ones)."""

    creates: tuple[dict[str, Any], ...] = ()
    updates: tuple[JobUpdate, ...] = ()
    deletes: tuple[JobDeletion, ...] = ()
    events: tuple[WorkloadEvent, ...] = ()
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)


# -- what to list ----------------------------------------------------------------------------------


def parse_policies(policies: Iterable[Obj]) -> tuple[dict[str, PerseusPolicySpec], dict[str, str]]:
    """The valid policies' specs by name, and the invalid ones' problems by name."""
    valid: dict[str, PerseusPolicySpec] = {}
    invalid: dict[str, str] = {}
    for body in policies:
        _, name = object_key(body)
        try:
            valid[name] = parse_policy(body)
        except PolicyError as exc:
            invalid[name or "?"] = str(exc)
    return valid, invalid


def namespace_labels(namespace: Obj) -> dict[str, str]:
    """A namespace's labels, with ``kubernetes.io/metadata.name`` as the API server sets it."""
    _, name = object_key(namespace)
    labels = (namespace.get("metadata") or {}).get("labels") or {}
    return {**{str(k): str(v) for k, v in labels.items()}, _NAMESPACE_NAME_LABEL: name}


def get_listing(
    policies: Mapping[str, PerseusPolicySpec], namespaces: Iterable[Obj]
) -> dict[str, set[WorkloadKind]]:
    """Namespace name -> the workload kinds some valid policy selects there."""
    listing: dict[str, set[WorkloadKind]] = {}
    for namespace in namespaces:
        labels = namespace_labels(namespace)
        for spec in policies.values():
            if matches(spec.namespace_selector, labels):
                _, name = object_key(namespace)
                listing.setdefault(name, set()).update(w.kind for w in spec.workloads)
    return listing


# -- the plan --------------------------------------------------------------------------------------


@dataclass
class _Round:
    """Working state of one :func:`get_sync_plan` call."""

    view: ClusterView
    policies: dict[str, PerseusPolicySpec]
    now: str
    creates: list[dict[str, Any]] = field(default_factory=list)
    updates: list[JobUpdate] = field(default_factory=list)
    deletes: list[JobDeletion] = field(default_factory=list)
    events: list[WorkloadEvent] = field(default_factory=list)
    managed: dict[str, list[str]] = field(default_factory=dict)  # policy -> workloads it manages
    unmanageable: dict[str, list[str]] = field(default_factory=dict)  # policy -> reasons
    overlaps: dict[str, list[str]] = field(default_factory=dict)  # loser -> "workload (winner)"
    jobs_after: dict[str, list[Obj]] = field(default_factory=dict)  # policy -> its jobs


def get_sync_plan(view: ClusterView, now: str) -> SyncPlan:
    """What to change so that the cluster matches the policies (see the module doc).

    ``now``: RFC 3339 time for the conditions that change in this round.
    """
    valid, invalid = parse_policies(view.policies)
    state = _Round(view, valid, now)
    namespace_labels_of = {object_key(n)[1]: namespace_labels(n) for n in view.namespaces}
    frozen = {label_value(name) for name in invalid}
    made_by_policy = {}
    for job in view.jobs:
        made_by = labels_of(job).get(MANAGED_BY_POLICY_LABEL)
        if made_by is not None and made_by not in frozen:
            made_by_policy[_owner_uid(job)] = job
    # Jobs of an invalid policy stay as they are until it is mended or deleted: one bad edit
    # must not delete every job (and profile) it manages.
    kept: set[tuple[str, str]] = {
        object_key(j) for j in view.jobs if labels_of(j).get(MANAGED_BY_POLICY_LABEL) in frozen
    }
    for workload, pods in _workloads(view):
        namespace, _ = object_key(workload)
        if namespace not in namespace_labels_of or _frozen_job(view.jobs, workload, frozen):
            continue
        existing = made_by_policy.get(_workload_uid(workload))
        if existing is not None:
            kept.add(object_key(existing))
        _decide(state, workload, pods, namespace_labels_of[namespace], existing)
    listing = get_listing(valid, view.namespaces)
    for job in made_by_policy.values():
        if object_key(job) not in kept and not terminating(job):
            namespace, name = object_key(job)
            state.deletes.append(JobDeletion(namespace, name, _orphan_reason(job, listing)))
    statuses = {
        name: status
        for name, body in _by_name(view.policies).items()
        if (status := _policy_status(state, name, body, invalid.get(name))) != body.get("status")
    }
    return SyncPlan(
        tuple(state.creates),
        tuple(state.updates),
        tuple(state.deletes),
        tuple(state.events),
        statuses,
    )


def _decide(
    state: _Round,
    workload: Obj,
    pods: tuple[Obj, ...],
    labels: Mapping[str, str],
    existing: Obj | None,
) -> None:
    """Create, update, delete or leave the workload's policy-made job; events on the way."""
    selecting = choose_policy(state.policies, labels, workload)
    user_job = user_job_for(state.view.jobs, workload, pods) if selecting else None
    choice = None if user_job else selecting
    if selecting is not None and user_job is not None:
        state.events.append(
            _event(
                workload,
                "Normal",
                "UserJobWins",
                f"the user's PerseusJob {user_job} manages this workload, not PerseusPolicy "
                f"{selecting.policy}",
            )
        )
    if choice is None:
        if existing is not None:
            why = (
                "it opted out"
                if opted_out(workload)
                else f"the user's PerseusJob {user_job} manages it"
                if user_job
                else "no PerseusPolicy selects its workload any more"
            )
            _delete(state, workload, existing, why)
        return
    state.managed.setdefault(choice.policy, []).append(_describe(workload))
    for loser in choice.others:
        state.overlaps.setdefault(loser, []).append(f"{_describe(workload)} ({choice.policy})")
    gpus_per_pod = choice.spec.rank_mapping.gpus_per_pod
    try:
        parallelism = infer_parallelism(workload, pods, gpus_per_pod=gpus_per_pod)
    except UnreadableParallelismError as exc:
        _unreadable(state, choice, workload, existing, str(exc))
        return
    _converge(state, choice, workload, parallelism, existing)


def _unreadable(
    state: _Round, choice: PolicyChoice, workload: Obj, existing: Obj | None, reason: str
) -> None:
    state.unmanageable.setdefault(choice.policy, []).append(reason)
    if existing is not None:
        state.jobs_after.setdefault(choice.policy, []).append(existing)
        what = f"kept PerseusJob {object_key(existing)[1]} as it is"
    else:
        what = "no PerseusJob created"
    state.events.append(
        _event(
            workload,
            "Warning",
            "ParallelismUnknown",
            f"PerseusPolicy {choice.policy} selects this workload, {what}: {reason}",
        )
    )


def _converge(
    state: _Round,
    choice: PolicyChoice,
    workload: Obj,
    parallelism: Parallelism,
    existing: Obj | None,
) -> None:
    desired = get_perseus_job(choice.policy, choice.spec, workload, parallelism)
    digest = spec_hash(desired)
    desired["metadata"]["annotations"] = {SPEC_HASH_ANNOTATION: digest}
    namespace, name = object_key(desired)
    if existing is None:
        taken = _job_named(state.view.jobs, namespace, name)
        if taken is not None:
            state.events.append(
                _event(
                    workload,
                    "Warning",
                    "NameTaken",
                    f"PerseusPolicy {choice.policy} cannot create PerseusJob {name}: a "
                    "PerseusJob of that name exists for another workload",
                )
            )
            return
        state.creates.append(desired)
        state.jobs_after.setdefault(choice.policy, []).append(desired)
        state.events.append(
            _event(
                workload, "Normal", "PolicyApplied", f"created PerseusJob {name}: {choice.message}"
            )
        )
        return
    state.jobs_after.setdefault(choice.policy, []).append(existing)
    if terminating(existing):  # being deleted: patched never; its successor comes once it is gone
        return
    if annotations_of(existing).get(SPEC_HASH_ANNOTATION) == digest:
        if choice.others:  # a policy that lost to this one since: say so (once; see key)
            state.events.append(_event(workload, "Normal", "PoliciesOverlap", choice.message))
        return
    _, existing_name = object_key(existing)
    new = {
        "metadata": {
            "labels": desired["metadata"]["labels"],
            "annotations": desired["metadata"]["annotations"],
        },
        "spec": desired["spec"],
    }
    old = {"metadata": {}, "spec": existing.get("spec") or {}}
    state.updates.append(JobUpdate(namespace, existing_name, merge_patch(old, new)))
    previous = labels_of(existing).get(MANAGED_BY_POLICY_LABEL)
    reason = "PolicyApplied" if previous == label_value(choice.policy) else "PolicyChanged"
    state.events.append(
        _event(
            workload,
            "Normal",
            reason,
            f"updated PerseusJob {existing_name} to what the policy asks: {choice.message}",
        )
    )


def _orphan_reason(job: Obj, listing: Mapping[str, set[WorkloadKind]]) -> str:
    namespace, _ = object_key(job)
    kind = ((job.get("spec") or {}).get("workload") or {}).get("kind")
    if any(kind == k.value for k in listing.get(namespace, ())):
        return "its workload is gone"
    return "no PerseusPolicy selects its workload any more"


def _delete(state: _Round, workload: Obj, job: Obj, why: str) -> None:
    if terminating(job):  # deleted already; its finalizer is resetting the GPUs
        return
    namespace, name = object_key(job)
    state.deletes.append(JobDeletion(namespace, name, why))
    state.events.append(
        _event(workload, "Normal", "PolicyReleased", f"deleted PerseusJob {name}: {why}")
    )


def spec_hash(job: Obj) -> str:
    """Hash of a policy-made job's label and spec: what the policy asked for."""
    asked = {"labels": labels_of(job), "spec": job.get("spec")}
    text = json.dumps(asked, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that turns ``old`` into ``new``: keys ``old`` has and
    ``new`` lacks are set to null (removed); nested objects recursively; anything else is
    replaced."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            patch[key] = merge_patch(before, value)
        else:
            patch[key] = value
    return patch


# -- statuses --------------------------------------------------------------------------------------


def _policy_status(state: _Round, name: str, body: Obj, problem: str | None) -> dict[str, Any]:
    return get_policy_status(
        body,
        problem,
        now=state.now,
        managed=state.managed.get(name, []),
        jobs=state.jobs_after.get(name, []),
        unmanageable=state.unmanageable.get(name, []),
        losses=state.overlaps.get(name, []),
    )


# -- objects ---------------------------------------------------------------------------------------


def _workloads(view: ClusterView) -> list[tuple[Obj, tuple[Obj, ...]]]:
    """Every workload of the view with its pods (those that tell its parallelism)."""
    found: list[tuple[Obj, tuple[Obj, ...]]] = []
    for workload in view.workloads:
        kind = workload_kind(workload)
        if kind is None or kind == WorkloadKind.PODS:
            continue
        label = PYTORCH_JOB_NAME if kind == WorkloadKind.PYTORCH_JOB else JOBSET_NAME
        namespace, name = object_key(workload)
        pods = tuple(
            p
            for p in view.pods
            if object_key(p)[0] == namespace and labels_of(p).get(label) == name
        )
        found.append((workload, pods))
    groups: list[PodGroup] = group_pods(view.pods)
    found.extend((g.workload, g.pods) for g in groups)
    return found


def _workload_uid(workload: Obj) -> str:
    if workload.get("kind") == WorkloadKind.PODS.value:
        return _owner_uid(workload)
    return str((workload.get("metadata") or {}).get("uid") or "")


def _owner_uid(obj: Obj) -> str:
    return str((controller_of(obj) or {}).get("uid") or "")


def _involved(workload: Obj) -> dict[str, str]:
    namespace, name = object_key(workload)
    ref = controller_of(workload)
    if workload.get("kind") == WorkloadKind.PODS.value and ref is not None:
        return {
            "apiVersion": str(ref.get("apiVersion", "")),
            "kind": str(ref.get("kind", "")),
            "name": str(ref.get("name", "")),
            "uid": str(ref.get("uid", "")),
            "namespace": namespace,
        }
    return {
        "apiVersion": str(workload.get("apiVersion", "")),
        "kind": str(workload.get("kind", "")),
        "name": name,
        "uid": str((workload.get("metadata") or {}).get("uid", "")),
        "namespace": namespace,
    }


def _event(
    workload: Obj, kind: Literal["Normal", "Warning"], reason: str, message: str
) -> WorkloadEvent:
    return WorkloadEvent(_involved(workload), kind, reason, message)


def _describe(workload: Obj) -> str:
    involved = _involved(workload)
    return f"{involved['kind']} {involved['namespace']}/{involved['name']}"


def _frozen_job(jobs: Iterable[Obj], workload: Obj, frozen: set[str]) -> bool:
    """Whether an invalid policy made the workload's job (it is left alone)."""
    uid = _workload_uid(workload)
    return any(
        labels_of(j).get(MANAGED_BY_POLICY_LABEL) in frozen and _owner_uid(j) == uid for j in jobs
    )


def _job_named(jobs: Iterable[Obj], namespace: str, name: str) -> Obj | None:
    return next((j for j in jobs if object_key(j) == (namespace, name)), None)


def _by_name(objects: Iterable[Obj]) -> dict[str, Obj]:
    return {object_key(o)[1]: o for o in objects if object_key(o)[1]}
