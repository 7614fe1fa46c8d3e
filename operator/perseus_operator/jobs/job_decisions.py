"""The decisions of a reconcile step that every phase shares: what a decision is, and the
checks each step makes before the phase's own (a new generation, the workload and its pods,
another job's node plans on the same GPUs).

Pure: each ``decide_*`` function takes what the step read (:mod:`perseus_operator.
job_observation`), the spec and the status so far, and returns a :class:`Decision`: the new
status, the events, and the :data:`Action` s that :mod:`perseus_operator.jobs.lifecycle` carries out
(the writes, and what the job's memo keeps). The status passed in is never changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from perseus_api import resources
from perseus_api.conventions import now_rfc3339, transition_time
from perseus_api.job import PerseusJobSpec, WorkloadKind
from perseus_api.job_status import Condition, ConditionType, PerseusJobStatus, Phase
from perseus_api.node_plan import NodePlan
from perseus_api.plan import PipelinePlan
from perseus_operator.jobs.gpu_conflicts import (
    CONFLICT_REASON,
    GpuClaim,
    claims_of_node_plans,
    decide_gpu_conflict,
    planned_gpus,
)
from perseus_operator.workloads.completion import workload_end, workload_failed, workload_finished
from perseus_operator.workloads.objects import labels_of
from perseus_operator.workloads.pods import WorkloadError
from perseus_operator.workloads.ranks import RankPlacement, Resolution, resolve_ranks
from perseus_operator.workloads.selectors import matches

__all__ = [
    "POD_FAILED_REASON",
    "POWER_TARGET_ANNOTATION",
    "STRAGGLER_STATE_ANNOTATION",
    "Action",
    "ConflictView",
    "Decision",
    "Event",
    "ForgetDetector",
    "JobRef",
    "PlanInEffect",
    "ReleaseNodePlans",
    "ReplaceNodePlans",
    "StatusDraft",
    "StoreProfile",
    "TargetFor",
    "WorkloadDecision",
    "WorkloadView",
    "copy_status",
    "decide_conflict",
    "decide_generation",
    "decide_workload",
    "gpus_of",
    "invalid_spec",
    "overlaps",
    "phase_event",
]

STRAGGLER_STATE_ANNOTATION: Final = f"{resources.GROUP}/straggler-state"
"""The straggler detector's memory, so a restarted operator neither forgets nor re-detects."""
POWER_TARGET_ANNOTATION: Final = f"{resources.GROUP}/power-target-seconds"
"""Written by the operator's power budget controller only: the frontier iteration time the job
is re-targeted to so that its power domain stays within its budget (absent: ``T_min``). The
job's plans are rewritten from its frontier for it, as for a straggler's ``T'``."""


def power_target_s(annotations: object) -> float | None:
    """The job's power target from its annotations; None when absent or not a positive
    number (the annotation is the operator's own; a bad one means no target)."""
    if not isinstance(annotations, dict):
        return None
    try:
        value = float(annotations.get(POWER_TARGET_ANNOTATION) or "nan")
    except (TypeError, ValueError):
        return None
    return value if value > 0 and value != float("inf") else None


POD_FAILED_REASON: Final = "PodFailed"
"""The Degraded reason while a pod of a workload object failed and its controller has not said
whether it runs the pod again or ends the workload."""


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to emit on the job."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class JobRef:
    namespace: str
    name: str
    uid: str
    generation: int
    owner: Mapping[str, Any]
    created: str = ""
    """``metadata.creationTimestamp``: the older of two jobs on the same GPUs keeps them."""


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaceNodePlans:
    """Write these node plans of the job and delete its others."""

    node_plans: Mapping[str, NodePlan]


@dataclass(frozen=True)
class ReleaseNodePlans:
    """Delete every node plan of the job (its agents reset the clocks)."""


@dataclass(frozen=True)
class StoreProfile:
    """Write the job's measured profile to ConfigMap ``name``."""

    name: str
    data: Mapping[str, str]
    labels: Mapping[str, str]


@dataclass(frozen=True)
class ForgetDetector:
    """Drop the straggler detector (a new generation starts counting afresh)."""


@dataclass(frozen=True)
class TargetFor:
    """The straggler target the plans are written for (None: T_min for all)."""

    retarget_s: float | None


@dataclass(frozen=True)
class PlanInEffect:
    """The plan of the healthy replicas now (for the savings metrics)."""

    plan: PipelinePlan


Action = (
    ReplaceNodePlans | ReleaseNodePlans | StoreProfile | ForgetDetector | TargetFor | PlanInEffect
)


@dataclass(frozen=True)
class Decision:
    """The status after one decision, with the events and actions it takes.

    ``go_on``: whether the step goes on to its next stage (False: it ends here).
    """

    status: PerseusJobStatus
    events: tuple[Event, ...] = ()
    actions: tuple[Action, ...] = ()
    go_on: bool = True


def copy_status(status: PerseusJobStatus) -> PerseusJobStatus:
    """A deep copy of ``status`` that a decision may edit. Through the model's own (compiled)
    schema: a quarter of the time of ``model_copy(deep=True)`` (pydantic's deep copy is pure
    Python), which every reconcile paid several times over (``benchmarks/operator_scale.py``'s
    profile). Every field of the copy counts as set; nothing reads the status's set fields."""
    return PerseusJobStatus.model_validate(status.model_dump(by_alias=True))


class StatusDraft:
    """A copy of the status that one decision edits, and the events and actions it adds."""

    def __init__(self, status: PerseusJobStatus, generation: int) -> None:
        self.status = copy_status(status)
        self.generation = generation
        self.events: list[Event] = []
        self.actions: list[Action] = []

    def decision(self, *, go_on: bool = True) -> Decision:
        return Decision(self.status, tuple(self.events), tuple(self.actions), go_on)

    def do(self, action: Action) -> None:
        self.actions.append(action)

    def event(self, kind: str, reason: str, message: str) -> None:
        self.events.append(Event(kind, reason, message))

    def condition(self, kind: ConditionType, ok: bool, reason: str, message: str = "") -> None:
        value: Literal["True", "False"] = "True" if ok else "False"
        for c in self.status.conditions:
            if c.type == kind:
                c.last_transition_time = transition_time(
                    value, c.status, c.last_transition_time, now_rfc3339()
                )
                c.status, c.reason, c.message = value, reason, message
                c.observed_generation = self.generation
                return
        self.status.conditions.append(
            Condition(
                type=kind,
                status=value,
                reason=reason,
                message=message,
                lastTransitionTime=now_rfc3339(),
                observedGeneration=self.generation,
            )
        )

    def fail(self, reason: str, message: str) -> None:
        if self.status.phase != Phase.FAILED or self.status.message != message:
            self.event("Warning", reason, message)
        self.status.phase = Phase.FAILED
        self.status.message = message
        self.status.observed_generation = self.generation
        self.condition(ConditionType.DEGRADED, True, reason, message)

    def wait(self, reason: str, message: str) -> None:
        self.status.message = message
        self.condition(ConditionType.DEGRADED, False, reason, message)

    def degraded(self, reason: str) -> bool:
        """Whether the Degraded condition is True for ``reason``."""
        return any(
            c.type == ConditionType.DEGRADED and c.reason == reason and c.status == "True"
            for c in self.status.conditions
        )


def invalid_spec(status: PerseusJobStatus, generation: int, message: str) -> Decision:
    d = StatusDraft(status, generation)
    d.fail("InvalidSpec", message)
    return d.decision(go_on=False)


def phase_event(before: PerseusJobStatus, after: PerseusJobStatus) -> Event | None:
    if after.phase == before.phase:
        return None
    return Event("Normal", "Phase", f"{before.phase.value} → {after.phase.value}")


# -- generation --------------------------------------------------------------------------------


def decide_generation(spec: PerseusJobSpec, status: PerseusJobStatus, generation: int) -> Decision:
    """The spec's mode and granularity in the status; a new generation plans again (the
    profile is reused when it still fits); a job that ended goes no further."""
    d = StatusDraft(status, generation)
    d.status.mode = spec.policy.mode
    d.status.granularity = spec.policy.granularity
    if status.observed_generation != generation and status.phase != Phase.COMPLETED:
        if status.observed_generation is not None:
            d.event("Normal", "SpecChanged", "spec changed; planning again")
        s = d.status
        s.phase = Phase.PENDING
        s.observed_generation = generation
        s.message = ""
        s.conditions = [
            c for c in s.conditions if c.type != ConditionType.DEGRADED or c.status != "True"
        ]
        d.do(ForgetDetector())
    return d.decision(go_on=d.status.phase not in (Phase.COMPLETED, Phase.FAILED))


# -- workload ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadView:
    """The job's workload as read: the object (None: missing, or a ``Pods`` workload) and its
    pods (not read when the object is missing or has ended)."""

    workload: Mapping[str, Any] | None = None
    pods: Sequence[Mapping[str, Any]] = ()


@dataclass(frozen=True)
class WorkloadDecision:
    """``ranks``: where each rank runs, when the step goes on to the phase."""

    decision: Decision
    ranks: tuple[RankPlacement, ...] | None = None


_RESOLVED_MAX: Final = 4096
"""Rank resolutions remembered: more than the jobs one operator runs."""
_resolved: OrderedDict[Hashable, Resolution] = OrderedDict()


def _resolved_ranks(pods: Sequence[Mapping[str, Any]], spec: PerseusJobSpec) -> Resolution:
    """:func:`resolve_ranks`, remembered per pod versions (uid and ``resourceVersion``, which
    every change of a pod changes) and placement spec: every reconcile of a running job
    resolves the same pods again, at a fifth of its CPU (``benchmarks/operator_scale.py``'s
    profile). Pods without both (hand-made ones) are resolved every time."""
    versions = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        uid, version = metadata.get("uid"), metadata.get("resourceVersion")
        if not (isinstance(uid, str) and uid and isinstance(version, str) and version):
            return resolve_ranks(pods, spec.workload, spec.parallelism, spec.rank_mapping)
        versions.append((uid, version))
    key = (
        tuple(versions),
        spec.workload.model_dump_json(),
        spec.parallelism.model_dump_json(),
        spec.rank_mapping.model_dump_json(),
    )
    found = _resolved.get(key)
    if found is None:
        found = resolve_ranks(pods, spec.workload, spec.parallelism, spec.rank_mapping)
        _resolved[key] = found
        if len(_resolved) > _RESOLVED_MAX:
            _resolved.popitem(last=False)
    else:
        _resolved.move_to_end(key)
    return found


def decide_workload(
    spec: PerseusJobSpec, status: PerseusJobStatus, ref: JobRef, view: WorkloadView
) -> WorkloadDecision:
    """Whether the workload runs (its ranks), waits (for the object, its pods, its
    controller's word on a failed pod) or has ended (the GPUs are released)."""
    d = StatusDraft(status, ref.generation)
    workload = spec.workload
    if workload.kind != WorkloadKind.PODS:
        if view.workload is None:
            d.wait(
                "WorkloadNotFound",
                f"{workload.kind.value} {ref.namespace}/{workload.name} does not exist "
                "(yet); waiting for it",
            )
            return WorkloadDecision(d.decision(go_on=False))
        ended = workload_end(workload.kind, view.workload)
        if ended is not None:  # by the workload object's own status, pods or not
            return WorkloadDecision(_ended(d, ended.failure))
    pods = list(view.pods)
    if workload.pod_selector is not None:  # the API's filtering is trusted, and checked
        selector = workload.pod_selector
        pods = [p for p in pods if matches(selector, labels_of(p))]
    try:
        resolution = _resolved_ranks(pods, spec)
    except WorkloadError as exc:
        d.fail("InvalidWorkload", str(exc))
        return WorkloadDecision(d.decision(go_on=False))
    if resolution.waiting is not None:
        if d.status.phase == Phase.PENDING:
            d.wait("WaitingForPods", resolution.waiting)
        else:  # running jobs whose pods are rescheduled keep their plans until they return
            d.condition(ConditionType.DEGRADED, True, "WaitingForPods", resolution.waiting)
        return WorkloadDecision(d.decision(go_on=False))
    d.status.nodes = sorted({r.node for r in resolution.ranks})
    if workload.kind == WorkloadKind.PODS:
        failure = workload_failed(pods)
        if workload_finished(pods) or failure is not None:
            return WorkloadDecision(_ended(d, failure))
    elif (failed := workload_failed(pods)) is not None:
        # A workload object ends by its controller's word: under restartPolicy
        # OnFailure/ExitCode or a backoffLimit the failed pod is run again, so the job keeps
        # its plans and waits for the retry or for the object's Failed condition.
        d.condition(
            ConditionType.DEGRADED,
            True,
            POD_FAILED_REASON,
            f"{failed}; waiting for the {workload.kind.value} to run it again or to end",
        )
        return WorkloadDecision(d.decision(go_on=False))
    _clear_pod_trouble(d)
    return WorkloadDecision(d.decision(), resolution.ranks)


def _ended(d: StatusDraft, failure: str | None) -> Decision:
    d.do(ReleaseNodePlans())
    if failure is not None:
        d.fail("WorkloadFailed", failure)
    else:
        d.status.phase = Phase.COMPLETED
        d.status.message = "the workload finished; every GPU clock was reset"
    return d.decision(go_on=False)


def _clear_pod_trouble(d: StatusDraft) -> None:
    """Every pod is back (retried, rescheduled): a Degraded condition that said otherwise
    turns False."""
    for c in d.status.conditions:
        if (
            c.type == ConditionType.DEGRADED
            and c.status == "True"
            and c.reason in (POD_FAILED_REASON, "WaitingForPods")
        ):
            d.condition(ConditionType.DEGRADED, False, "PodsRunning", "every pod runs")


# -- GPU conflicts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ConflictView:
    """The node plans of the namespace's other jobs (those on this job's nodes), and its jobs
    (for their ages; read only when some plan is on one of this job's GPUs, :func:`gpus_of`)."""

    others: Sequence[Mapping[str, Any]]
    jobs: Sequence[Mapping[str, Any]] = ()


def gpus_of(ranks: Sequence[RankPlacement]) -> frozenset[tuple[str, str]]:
    return frozenset((r.node, r.gpu_key) for r in ranks)


def overlaps(others: Sequence[Mapping[str, Any]], ranks: Sequence[RankPlacement]) -> bool:
    """Whether some of ``others`` is planned on one of the GPUs of ``ranks``."""
    return bool(planned_gpus(others) & gpus_of(ranks))


def decide_conflict(
    status: PerseusJobStatus, ref: JobRef, ranks: Sequence[RankPlacement], view: ConflictView
) -> Decision:
    """Whether another, older job's node plans hold some of this job's GPUs; if so this job
    withdraws its own node plans and waits (condition ``GpuConflict``, ``go_on`` False)."""
    d = StatusDraft(status, ref.generation)
    conflict = None
    if overlaps(view.others, ranks):
        me = GpuClaim(ref.namespace, ref.name, ref.created, gpus_of(ranks))
        conflict = decide_gpu_conflict(me, claims_of_node_plans(view.others, view.jobs))
    held = d.degraded(CONFLICT_REASON)
    if conflict is None:
        if held:
            d.condition(ConditionType.DEGRADED, False, "GpuConflictResolved")
            d.status.message = ""
        return d.decision()
    d.do(ReleaseNodePlans())
    if not held or d.status.message != conflict.message:
        d.event("Warning", CONFLICT_REASON, conflict.message)
    d.status.phase = Phase.PENDING
    d.status.message = conflict.message
    d.condition(ConditionType.DEGRADED, True, CONFLICT_REASON, conflict.message)
    return d.decision(go_on=False)
