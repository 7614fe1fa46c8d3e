"""The node agent's Kubernetes I/O: its node's plans in, per-GPU reports out.

The only module of the agent that talks to the Kubernetes API (the ``kubernetes`` client,
imported lazily, so standalone agents do not need it). The objects are PerseusNodePlans
(:mod:`perseus_api.resources`): one per (job, node), spec a NodePlan, status the agent's report.

- :class:`NodePlanSource` lists and then watches the node plans of this node in all
  namespaces (label ``perseus.energy/node=<node>``; objects are also checked client-side, by
  label and by ``spec.node``) in a background thread, and calls ``on_plan`` for every new or
  changed plan, ``on_delete`` when one goes away and ``on_invalid`` for a malformed one. It
  resumes after a watch ends, expires (410 Gone: it lists again and reports what changed
  meanwhile) or fails (connection errors: exponential backoff), and never stops on bad data.
  Needs RBAC: ``list`` and ``watch`` on ``perseusnodeplans.perseus.energy`` in all
  namespaces.
- :class:`ReportWriter` patches each object's ``status`` subresource from a background
  thread: latest report wins, unchanged reports are not re-sent, conflicts, throttling, server
  errors and connection errors are retried a bounded number of times, and nothing raises into
  the agent loop. Needs RBAC: ``patch`` on ``perseusnodeplans/status``.
- :class:`NodeLabelSource` reads this node's object every few seconds for one label, the GPU
  Operator's driver upgrade state (:mod:`perseus_agent.driver_upgrade`), and calls back when
  it changes. Needs RBAC: ``get`` on ``nodes``.
- :func:`arbitrate_gpus` (pure): one job per GPU. When plans of several jobs claim the same
  GPU, the *older* plan keeps it — older meaning delivered first by the source, which delivers
  the objects of its first listing in ``creationTimestamp`` order, so a restarted agent picks
  the same winners — and the newer plan gets that GPU reported ``Failed``.
- :func:`report_status`, :func:`invalid_status` (pure): the status documents.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TypeVar

from perseus_agent.applier import GpuReport, GpuStatus, NodeReport, PlanApplier
from perseus_agent.errors import AgentError
from perseus_agent.exporter import AgentMetrics, ManagedGpu
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_agent.gpu_ownership import Binding, LocalRankIndexOwnership, Ownership, PeerPod
from perseus_agent.local_server import RequestError
from perseus_agent.reset_state import ResetState
from perseus_api import kube_client, resources
from perseus_api.conventions import now_rfc3339, transition_time
from perseus_api.kube_client import describe_api_error, http_status
from perseus_api.node_plan import GpuAssignment, NodePlan
from perseus_api.node_report import NodePlanStatus, StatusCondition, status_document
from perseus_api.plan import Granularity

if TYPE_CHECKING:
    from perseus_agent.local_server import ClientSession
    from perseus_client.protocol import (
        HelloRequest,
        InstructionBeginRequest,
        InstructionEndRequest,
        StepBeginRequest,
        StepEndRequest,
    )

__all__ = [
    "GpuGrant",
    "JobPlans",
    "KubeConfigError",
    "NodeLabelSource",
    "NodePlanSource",
    "ReportWriter",
    "arbitrate_gpus",
    "core_v1_api",
    "invalid_status",
    "load_api_client",
    "report_status",
    "resolve_gpu",
    "restrict_plan",
]

log = logging.getLogger(__name__)

ObjectKey = tuple[str, str]
"""``(namespace, name)`` of a node plan object."""
K = TypeVar("K", bound=Hashable)

WATCH_TIMEOUT_S: Final = 300
"""Server-side end of each watch request; the source then watches again from where it was."""
REQUEST_TIMEOUT_S: Final = 30.0
"""Connect timeout, and read timeout of requests other than watches, in seconds."""
MIN_BACKOFF_S: Final = 0.5
MAX_BACKOFF_S: Final = 30.0
_HTTP_GONE: Final = 410
_RETRIABLE_HTTP: Final = frozenset({409, 429, 500, 502, 503, 504})
_RBAC_HINT: Final = (
    f" (the agent's service account needs list and watch on {resources.NODE_PLAN_PLURAL}"
    f".{resources.GROUP} in all namespaces, and patch on their status)"
)
_HINTS: Final = {
    401: " (the agent's credentials are not accepted)",
    403: _RBAC_HINT,
    404: f" (is the {resources.NODE_PLAN_KIND} CustomResourceDefinition installed?)",
}


class KubeConfigError(AgentError):
    """No usable Kubernetes client configuration (not in a cluster, bad kubeconfig, ...)."""


def load_api_client(kubeconfig: str | None) -> Any:
    """A ``kubernetes.client.ApiClient``: from ``kubeconfig`` (a path, or several separated
    like ``$KUBECONFIG``) if given, else the pod's in-cluster service account.

    Nothing is requested from the API here.

    Raises:
        KubeConfigError: The configuration cannot be loaded.
    """
    return kube_client.load_api_client(
        kubeconfig,
        KubeConfigError,
        in_cluster_hint=" (not running in a pod? pass --kubeconfig or --standalone)",
        extra="agent",
    )


def custom_objects_api(api_client: Any) -> Any:
    """A ``kubernetes.client.CustomObjectsApi`` on ``api_client``."""
    from kubernetes import client

    return client.CustomObjectsApi(api_client)


# -- GPU arbitration (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuGrant:
    """What one plan may apply after arbitration."""

    plan: NodePlan
    """The plan without the assignments of GPUs an older plan holds."""
    gpu_indices: frozenset[int]
    """The GPUs of this node the plan holds."""
    denied: tuple[GpuReport, ...]
    """A ``Failed`` report for each GPU an older plan holds."""


def resolve_gpu(assignment: GpuAssignment, devices: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU of ``devices`` an assignment means: by UUID if it has one, else by index."""
    for gpu in devices:
        if assignment.gpu_uuid is not None:
            if gpu.uuid == assignment.gpu_uuid:
                return gpu
        elif gpu.index == assignment.gpu_index:
            return gpu
    return None


def arbitrate_gpus(
    plans: Sequence[tuple[K, NodePlan]], devices: Sequence[GpuInfo]
) -> dict[K, GpuGrant]:
    """One job per GPU: ``plans`` oldest first; a GPU goes to the first plan that claims it.

    Assignments of GPUs that do not exist on the node are left in the plan (the applier
    reports them); so are two assignments of one GPU in the same plan.
    """
    owners: dict[int, NodePlan] = {}
    grants: dict[K, GpuGrant] = {}
    for key, plan in plans:
        granted: list[GpuAssignment] = []
        denied: list[GpuReport] = []
        mine: set[int] = set()
        for a in plan.assignments:
            gpu = resolve_gpu(a, devices)
            owner = None if gpu is None else owners.get(gpu.index)
            if gpu is None or owner is None:
                granted.append(a)
                if gpu is not None:
                    mine.add(gpu.index)
                continue
            stage_plan = plan.plans[a.plan].stages[a.stage]
            denied.append(
                GpuReport(
                    uuid=gpu.uuid,
                    index=gpu.index,
                    plan=a.plan,
                    stage=a.stage,
                    dp_rank=a.dp_rank,
                    rank=a.rank,
                    target_mhz=(
                        stage_plan.frequency_mhz if plan.granularity == Granularity.STAGE else None
                    ),
                    applied_mhz=None,
                    status=GpuStatus.FAILED,
                    message=(
                        f"gpu_conflict: GPU {gpu.index} ({gpu.uuid}) is used by job "
                        f"{owner.namespace}/{owner.job}, whose plan is older"
                    ),
                )
            )
        for index in mine:
            owners[index] = plan
        restricted = plan.model_copy(update={"assignments": granted}) if denied else plan
        grants[key] = GpuGrant(restricted, frozenset(mine), tuple(denied))
    return grants


def restrict_plan(plan: NodePlan, devices: Sequence[GpuInfo], keep: frozenset[int]) -> NodePlan:
    """``plan`` without its assignments of GPUs (of ``devices``) outside ``keep``."""
    assignments = [
        a for a in plan.assignments if (gpu := resolve_gpu(a, devices)) is None or gpu.index in keep
    ]
    if len(assignments) == len(plan.assignments):
        return plan
    return plan.model_copy(update={"assignments": assignments})


# -- the plans of several jobs ---------------------------------------------------------------------


@dataclass
class _Job:
    plan: NodePlan
    """As bound to this node's GPUs (:mod:`perseus_agent.gpu_ownership`)."""
    applier: PlanApplier
    source: NodePlan | None = None
    """As the operator wrote it."""
    binding: Binding | None = None
    grant: GpuGrant | None = None
    """What was last applied (``None``: apply at the next reconciliation)."""
    error: str | None = None
    """Why the last apply failed, if it did."""


class JobPlans:
    """The node plans of this node's jobs (Kubernetes mode): one applier per plan object.

    Every plan gets its own :class:`~perseus_agent.applier.PlanApplier` (sharing the backend,
    the reset record and the metrics). :func:`arbitrate_gpus` keeps their GPUs disjoint, the
    older plan winning; after every change the GPUs a plan loses are released before any plan
    locks the GPUs it gains.

    Every plan is first bound to the node's GPUs by ``ownership`` (default: process local
    rank = GPU index, trusted; the agent passes
    :class:`~perseus_agent.gpu_ownership.KubeletOwnership`): the assignments it refuses are
    reported ``Failed`` with the reason, and bound again at every :meth:`refresh_ownership`.

    Also the local server's handler: each training process is routed to the applier of its
    job — with kubelet ownership, the plan of its pod (told by ``ownership.peer_pod``; a
    process claiming GPUs its pod was not allocated is refused), and it drives only GPUs its
    pod owns; otherwise the plan holding one of its GPUs (by UUID), else the plan of the job
    its hello names, else the only plan assigning its rank — and routed again whenever the
    plans change. A process no plan matches gets unmanaged replies (no clock).

    Thread-safe: plans change on the agent loop, training processes call in on server threads.

    Raises:
        GpuError: The backend cannot list its GPUs.
    """

    def __init__(
        self,
        backend: GpuBackend,
        reset_state: ResetState,
        node_name: str,
        metrics: AgentMetrics | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        self._backend = backend
        self._reset_state = reset_state
        self.node_name = node_name
        self.metrics = metrics if metrics is not None else AgentMetrics(node_name)
        self.devices: list[GpuInfo] = backend.devices()
        self._uuids = {g.index: g.uuid for g in self.devices}
        self._ownership: Ownership = ownership or LocalRankIndexOwnership()
        self._lock = threading.RLock()
        self._jobs: dict[ObjectKey, _Job] = {}  # oldest first
        self._routes: dict[ClientSession, ObjectKey | None] = {}
        self._peers: dict[ClientSession, PeerPod | None] = {}

    # -- plans -------------------------------------------------------------------------------------

    def objects(self) -> list[ObjectKey]:
        """The plan objects, oldest first."""
        with self._lock:
            return list(self._jobs)

    def plans(self) -> dict[ObjectKey, NodePlan]:
        """The plan of every object, oldest first (to apply them again after a release)."""
        with self._lock:
            return {key: job.plan for key, job in self._jobs.items()}

    def set_plan(self, key: ObjectKey, plan: NodePlan) -> list[ObjectKey]:
        """A plan object is new or changed: apply it. Returns the plans whose state changed."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                applier = PlanApplier(
                    self._backend, self._reset_state, self.node_name, self.metrics
                )
                job = self._jobs[key] = _Job(plan, applier)
            job.source, job.grant = plan, None
            self._bind(job, plan)
            return sorted({key, *self._reconcile()})

    def refresh_ownership(self) -> list[ObjectKey]:
        """Bind every plan again (pods start, restart and end); the plans whose state changed.

        The kubelet is asked outside the lock: training processes' hooks do not wait for it.
        """
        with self._lock:
            sources = {k: j.source for k, j in self._jobs.items() if j.source is not None}
        bindings = {k: self._ownership.bind(plan, self.devices) for k, plan in sources.items()}
        with self._lock:
            rebound = []
            for key, binding in bindings.items():
                job = self._jobs.get(key)
                if job is None or job.source is not sources[key] or job.binding == binding:
                    continue  # gone, replaced meanwhile (and bound then), or unchanged
                self._adopt(job, binding)
                job.grant = None
                rebound.append(key)
            if not rebound:
                return []
            return sorted({*rebound, *self._reconcile()})

    def _bind(self, job: _Job, plan: NodePlan) -> None:
        self._adopt(job, self._ownership.bind(plan, self.devices))

    def _adopt(self, job: _Job, binding: Binding) -> None:
        before = {r.message for r in job.binding.denied} if job.binding is not None else set()
        for report in binding.denied:
            if report.message not in before:
                before.add(report.message)
                log.error("plan %s: %s", _job_name(binding.plan), report.message)
                self.metrics.count_error(report.message.split(":", 1)[0])
        job.plan, job.binding = binding.plan, binding

    def remove(self, key: ObjectKey) -> list[ObjectKey]:
        """A plan object is gone: reset its GPUs. Returns the plans whose state changed."""
        with self._lock:
            job = self._jobs.pop(key, None)
            if job is None:
                return []
            job.applier.clear()
            return self._reconcile()

    def clear(self) -> None:
        """Reset every clock of every plan and forget the plans."""
        with self._lock:
            for job in self._jobs.values():
                try:
                    job.applier.clear()
                except Exception:
                    log.exception("error while resetting the clocks of %s", _job_name(job.plan))
            self._jobs.clear()
            self._reroute()

    def report(self, key: ObjectKey) -> NodeReport | None:
        """The state of plan ``key`` (GPUs denied to it included), if it is applied."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.error is not None:
                return None
            report = job.applier.report()
            denied = (
                *(job.binding.denied if job.binding is not None else ()),
                *(job.grant.denied if job.grant is not None else ()),
            )
        if report is None or not denied:
            return report
        return report.model_copy(update={"gpus": [*report.gpus, *denied]})

    def status(self, key: ObjectKey) -> dict[str, Any] | None:
        """The ``status`` document of plan ``key``; ``None`` for an unknown plan."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                return None
            if job.error is not None:
                return invalid_status(job.error, job.plan.revision, resources.REASON_FAILED)
        report = self.report(key)
        return None if report is None else report_status(report)

    def locked_gpus(self) -> list[int]:
        """Indices of the GPUs whose clocks the agent locked and has not reset."""
        with self._lock:
            locked = {e.index for e in self._reset_state.entries()}
            for job in self._jobs.values():
                locked.update(job.applier.locked_gpus())
            return sorted(locked)

    def managed_gpus(self) -> dict[int, ManagedGpu]:
        """The GPUs under a plan, by index (for the exporter)."""
        with self._lock:
            appliers = [job.applier for job in self._jobs.values()]
        managed: dict[int, ManagedGpu] = {}
        for applier in appliers:
            managed.update(applier.managed_gpus())
        return managed

    def _reconcile(self) -> list[ObjectKey]:
        grants = arbitrate_gpus([(k, j.plan) for k, j in self._jobs.items()], self.devices)
        changed = [k for k, j in self._jobs.items() if j.grant != grants[k]]
        # First release the GPUs that change hands, then lock them for their new plans.
        for key in changed:
            job, grant = self._jobs[key], grants[key]
            held = frozenset(job.applier.managed_gpus())
            if held - grant.gpu_indices:
                keep = restrict_plan(grant.plan, self.devices, held & grant.gpu_indices)
                self._apply(job, keep)
        for key in changed:
            job, grant = self._jobs[key], grants[key]
            before = {g.index for g in job.grant.denied} if job.grant is not None else set()
            for report in grant.denied:
                if report.index not in before:
                    log.error("plan %s: %s", _job_name(job.plan), report.message)
                    self.metrics.count_error("gpu_conflict")
            self._apply(job, grant.plan)
            job.grant = grant
        self._reroute()
        return changed

    def _apply(self, job: _Job, plan: NodePlan) -> None:
        try:
            job.applier.apply(plan)
        except Exception as exc:  # never crash on a plan
            log.exception("cannot apply plan %s; its clocks are reset", _job_name(plan))
            self.metrics.count_error("invalid_plan")
            job.applier.clear()
            job.error = f"cannot apply the plan: {exc}"
        else:
            job.error = None

    # -- training processes (the local server's handler) -------------------------------------------

    def _identify(self, session: ClientSession) -> PeerPod | None:
        """The pod of ``session``'s process (raises RequestError to refuse it)."""
        plans = [j.plan for j in self._jobs.values()]
        peer = self._ownership.peer_pod(session, plans, self.devices)
        self._peers[session] = peer
        if peer is not None:
            log.info(
                "training process (pid %s) is in pod %s/%s (by %s), which owns GPU(s) %s",
                session.peer_pid,
                peer.namespace,
                peer.name,
                peer.how,
                ", ".join(sorted(peer.gpu_uuids)) or "none",
            )
        return peer

    def _route(self, session: ClientSession) -> ObjectKey | None:
        hello = session.hello
        if hello is None:
            return None
        jobs = [(k, j) for k, j in self._jobs.items() if j.grant is not None]
        if self._ownership.verifies_peers:
            peer = self._peers.get(session)
            if peer is None:
                return None
            for key, job in jobs:
                assert job.grant is not None
                if job.plan.namespace == peer.namespace and any(
                    a.pod == peer.name for a in job.grant.plan.assignments
                ):
                    return key
            return None
        uuids = set(hello.get("gpu_uuids") or ())
        for key, job in jobs:
            assert job.grant is not None
            if any(self._uuids.get(i) in uuids for i in job.grant.gpu_indices):
                return key
        name, namespace = hello.get("job"), hello.get("namespace")
        for key, job in jobs:
            if name and job.plan.job == name and namespace in (None, "", job.plan.namespace):
                return key
        rank = hello.get("rank")
        if rank is not None:
            matches = [
                key
                for key, job in jobs
                if job.grant is not None and any(a.rank == rank for a in job.grant.plan.assignments)
            ]
            if len(matches) == 1:
                return matches[0]
        return None

    def _reroute(self) -> None:
        now_ns = time.monotonic_ns()
        for session, old in list(self._routes.items()):
            if self._peers.get(session) is None and session.hello is not None:
                # A plan may have arrived for the pod of a process that called in first; a
                # refused one is logged and stays unmanaged.
                with contextlib.suppress(RequestError):
                    self._identify(session)
            new = self._route(session)
            if new == old:
                continue
            self._routes[session] = new
            if old is not None and old in self._jobs:
                self._jobs[old].applier.disconnected(session)
            if new is not None and session.hello is not None:
                self._jobs[new].applier.hello(
                    session, session.hello, now_ns, owned_uuids=self._owned(session)
                )

    def _owned(self, session: ClientSession) -> frozenset[str] | None:
        if not self._ownership.verifies_peers:
            return None
        peer = self._peers.get(session)
        return peer.gpu_uuids if peer is not None else frozenset()

    def _applier(self, session: ClientSession) -> PlanApplier | None:
        with self._lock:
            key = self._routes.get(session)
            job = self._jobs.get(key) if key is not None else None
            return job.applier if job is not None else None

    def hello(
        self, session: ClientSession, msg: HelloRequest, received_ns: int = 0
    ) -> dict[str, Any]:
        with self._lock:
            self._identify(session)
            key = self._route(session)
            self._routes[session] = key
            applier = self._jobs[key].applier if key is not None else None
            owned = self._owned(session)
        if applier is not None:
            return applier.hello(session, msg, received_ns, owned_uuids=owned)
        log.info(
            "training process rank %s (pid %s) called in; no plan on this node matches it",
            msg.get("rank"),
            msg.get("pid"),
        )
        return {
            "ok": True,
            "node": self.node_name,
            "managed": False,
            "granularity": None,
            "gpus": [],
        }

    def step_begin(
        self, session: ClientSession, msg: StepBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        applier = self._applier(session)
        return {"ok": True} if applier is None else applier.step_begin(session, msg, t_ns)

    def step_end(self, session: ClientSession, msg: StepEndRequest, t_ns: int) -> dict[str, Any]:
        applier = self._applier(session)
        return {"ok": True} if applier is None else applier.step_end(session, msg, t_ns)

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, t_ns: int
    ) -> dict[str, Any]:
        applier = self._applier(session)
        if applier is None:
            return {"ok": True, "sm_clock_mhz": None}
        return applier.instruction_begin(session, msg, t_ns)

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, t_ns: int
    ) -> dict[str, Any]:
        applier = self._applier(session)
        return {"ok": True} if applier is None else applier.instruction_end(session, msg, t_ns)

    def disconnected(self, session: ClientSession) -> None:
        with self._lock:
            key = self._routes.pop(session, None)
            self._peers.pop(session, None)
            job = self._jobs.get(key) if key is not None else None
        if job is not None:
            job.applier.disconnected(session)


def _gpu_name(g: GpuReport) -> str:
    if g.index is not None:
        return str(g.index)
    return g.uuid if g.uuid is not None else f"of rank {g.rank}"


def _job_name(plan: NodePlan) -> str:
    return f"{plan.namespace}/{plan.job}"


# -- status documents (pure) -----------------------------------------------------------------------


def report_status(report: NodeReport, denied: Sequence[GpuReport] = ()) -> dict[str, Any]:
    """The ``status`` of a node plan applied as ``report`` says (plus GPUs ``denied`` to it)."""
    if denied:
        report = report.model_copy(update={"gpus": [*report.gpus, *denied]})
    failed = [g for g in report.gpus if g.status == GpuStatus.FAILED]
    counts: dict[str, int] = {}
    for g in report.gpus:
        counts[g.status] = counts.get(g.status, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no GPUs assigned"
    if failed:
        details = "; ".join(f"GPU {_gpu_name(g)}: {g.message}" for g in failed)
        condition = _condition(False, resources.REASON_FAILED, f"{summary}: {details}")
    else:
        condition = _condition(True, resources.REASON_APPLIED, summary)
    status = NodePlanStatus.of_report(
        report,
        # Changes with every periodic report, so that each is written: the operator tells a
        # live agent from a dead one by it.
        reported_at=datetime.now(tz=UTC).isoformat(timespec="milliseconds"),
        conditions=[condition],
    )
    return status_document(status)


def invalid_status(
    message: str, revision: int | None, reason: str = resources.REASON_INVALID_SPEC
) -> dict[str, Any]:
    """The ``status`` of a node plan that is not applied at all; ``message`` says why (the
    report's fields are written null, which removes a previous report's)."""
    status = NodePlanStatus(
        observed_revision=revision, conditions=[_condition(False, reason, message)]
    )
    return status_document(status)


def stopped_status(revision: int | None, *, reset_ok: bool) -> dict[str, Any]:
    """The ``status`` of a node plan whose agent stopped (its clocks reset, if ``reset_ok``)."""
    if reset_ok:
        message = (
            "the node agent stopped and reset every GPU clock of this plan; "
            "it applies the plan again when it restarts"
        )
    else:
        message = (
            "the node agent stopped but could not reset every GPU clock it changed on this "
            "node (see the agent's log); it resets them when it restarts"
        )
    return invalid_status(message, revision, reason=resources.REASON_AGENT_STOPPED)


def _condition(ok: bool, reason: str, message: str) -> StatusCondition:
    return StatusCondition(
        type=resources.CONDITION_APPLIED,
        status="True" if ok else "False",
        reason=reason,
        message=message,
    )


def _with_transition_times(
    status: Mapping[str, Any], previous: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``status`` with each condition's ``lastTransitionTime``: the previous one's if the
    condition's status did not change, else now."""
    before = {
        c.get("type"): c for c in (previous or {}).get("conditions") or () if isinstance(c, Mapping)
    }
    now = now_rfc3339()
    conditions = []
    for c in status.get("conditions") or ():
        old = before.get(c.get("type")) or {}
        since = transition_time(c["status"], old.get("status"), old.get("lastTransitionTime"), now)
        conditions.append({**c, "lastTransitionTime": since})
    return {**status, "conditions": conditions}


# -- API errors ------------------------------------------------------------------------------------


class _Backoff:
    """Exponential backoff with jitter, ``min_s`` to ``max_s`` seconds."""

    def __init__(self, min_s: float, max_s: float) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._next = min_s

    def reset(self) -> None:
        self._next = self.min_s

    def next(self) -> float:
        delay = self._next
        self._next = min(self.max_s, self._next * 2)
        return delay * random.uniform(0.8, 1.2)


# -- plans in --------------------------------------------------------------------------------------


class _WatchExpiredError(Exception):
    """The watch's resource version is too old (410 Gone): list again."""


@dataclass(frozen=True)
class _Seen:
    uid: str | None
    fingerprint: str


PlanCallback = Callable[[str, str, NodePlan], None]
DeleteCallback = Callable[[str, str], None]
InvalidCallback = Callable[[str, str, str, int | None], None]


class NodePlanSource:
    """The node plans of one node, from the Kubernetes API, as callbacks.

    Callbacks run on the source's thread, one at a time, in the order of the events:

    - ``on_plan(namespace, name, plan)``: a plan for this node appeared or its spec changed
      (a status update or a re-listing of an unchanged object calls nothing);
    - ``on_delete(namespace, name)``: a plan delivered before (by ``on_plan`` or
      ``on_invalid``) is gone — deleted, relabelled for another node, or deleted and created
      again (then ``on_plan`` follows);
    - ``on_invalid(namespace, name, message, revision)``: the object is labelled for this node
      but its spec is not a valid NodePlan for it; ``revision`` is ``spec.revision`` if it is
      an integer. The message names the object and the problem. Logged, never raised.

    A callback that raises is logged; the source goes on.

    Args:
        api: A ``kubernetes.client.CustomObjectsApi`` (or anything with its
            ``list_cluster_custom_object``).
        node_name: This node.
        watch_timeout_s: Server-side timeout of each watch request.
        request_timeout_s: Connect timeout, and read timeout of the listing.
        min_backoff_s, max_backoff_s: Retry delays after errors (doubling, with jitter).
    """

    def __init__(
        self,
        api: Any,
        node_name: str,
        on_plan: PlanCallback,
        on_delete: DeleteCallback,
        on_invalid: InvalidCallback | None = None,
        *,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self._api = api
        self.node_name = node_name
        self._label = resources.label_value(node_name)
        self.selector = resources.node_label_selector(node_name)
        self._on_plan = on_plan
        self._on_delete = on_delete
        self._on_invalid = on_invalid
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._backoff = _Backoff(min_backoff_s, max_backoff_s)
        self._known: dict[ObjectKey, _Seen] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream_lock = threading.Lock()
        self._stream: Any = None
        self.synced = threading.Event()
        """Set once the first listing has been delivered."""

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start listing and watching in a background (daemon) thread."""
        self._thread = threading.Thread(target=self.run, name="perseus-plans", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching; no callback is called after this returns (unless it times out)."""
        self._stop.set()
        self._abort_stream()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the plan watch did not stop within %.1f s", timeout_s)

    def run(self) -> None:
        """List and watch until :meth:`stop` (the thread's body)."""
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._list()
                if failures:
                    log.info("Kubernetes API reachable again; watching node plans")
                failures = 0
                self._backoff.reset()
                while not self._stop.is_set():
                    started = time.monotonic()
                    version = self._watch(version)
                    if time.monotonic() - started < 1.0:  # a server ending watches at once
                        self._stop.wait(MIN_BACKOFF_S)
            except _WatchExpiredError as exc:
                log.info("watch of node plans expired (%s); listing them again", exc)
            except Exception as exc:
                if self._stop.is_set():
                    break
                if http_status(exc) == _HTTP_GONE:
                    log.info("watch of node plans expired; listing them again")
                    continue
                failures += 1
                delay = self._backoff.next()
                (log.error if failures == 1 else log.warning)(
                    "cannot list/watch %s (%s) for node %s: %s%s; retrying in %.1f s",
                    resources.NODE_PLAN_PLURAL,
                    self.selector,
                    self.node_name,
                    describe_api_error(exc),
                    _HINTS.get(http_status(exc) or 0, ""),
                    delay,
                )
                self._stop.wait(delay)

    # -- listing and watching ----------------------------------------------------------------------

    def _list(self) -> str | None:
        result = self._api.list_cluster_custom_object(
            resources.GROUP,
            resources.VERSION,
            resources.NODE_PLAN_PLURAL,
            label_selector=self.selector,
            _request_timeout=self._request_timeout_s,
        )
        if not isinstance(result, Mapping):
            raise TypeError(f"unexpected list response: {type(result).__name__}")
        items = [i for i in result.get("items") or () if isinstance(i, Mapping)]
        items.sort(key=_creation_order)
        seen: set[ObjectKey] = set()
        for item in items:
            if self._stop.is_set():
                return None
            key = self._upsert(item)
            if key is not None:
                seen.add(key)
        for key in [k for k in self._known if k not in seen]:
            self._gone(key)
        self.synced.set()
        version = (result.get("metadata") or {}).get("resourceVersion")
        return version if isinstance(version, str) and version else None

    def _watch(self, version: str | None) -> str | None:
        kwargs: dict[str, Any] = {
            "label_selector": self.selector,
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": self._watch_timeout_s,
            "_preload_content": False,
            "_request_timeout": (self._request_timeout_s, self._watch_timeout_s + 30.0),
        }
        if version:
            kwargs["resource_version"] = version
        response = self._api.list_cluster_custom_object(
            resources.GROUP, resources.VERSION, resources.NODE_PLAN_PLURAL, **kwargs
        )
        with self._stream_lock:
            self._stream = response
        try:
            if self._stop.is_set():
                return version
            for line in _lines(response):
                if self._stop.is_set():
                    break
                version = self._event(line) or version
        finally:
            with self._stream_lock:
                self._stream = None
            _close(response)
        return version

    def _abort_stream(self) -> None:
        with self._stream_lock:
            response = self._stream
        if response is not None:
            shutdown = getattr(response, "shutdown", None)  # urllib3 >= 2.3: unblocks a read
            try:
                if callable(shutdown):
                    shutdown()
                else:
                    _close(response)
            except Exception:
                log.debug("error while aborting the watch", exc_info=True)

    def _event(self, line: str) -> str | None:
        """Handle one watch event; returns its resource version, if any."""
        try:
            event = json.loads(line)
        except ValueError:
            log.warning("ignoring a malformed watch event: %.200s", line)
            return None
        if not isinstance(event, Mapping) or not isinstance(event.get("object"), Mapping):
            log.warning("ignoring a malformed watch event: %.200s", line)
            return None
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            code, message = obj.get("code"), obj.get("message", "")
            if code == _HTTP_GONE:
                raise _WatchExpiredError(message or "410 Gone")
            raise RuntimeError(f"watch error {code}: {message}")
        metadata = obj.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
        if kind in ("ADDED", "MODIFIED"):
            self._upsert(obj)
        elif kind == "DELETED":
            namespace, name = resources.object_key(obj)
            self._gone((namespace, name))
        return version if isinstance(version, str) and version else None

    # -- objects -----------------------------------------------------------------------------------

    def _upsert(self, obj: Mapping[str, Any]) -> ObjectKey | None:
        """Deliver ``obj`` if it is new or changed; its key if it is for this node."""
        namespace, name = resources.object_key(obj)
        if not namespace or not name:
            log.warning("ignoring a %s without namespace or name", resources.NODE_PLAN_KIND)
            return None
        key = (namespace, name)
        metadata = obj.get("metadata")
        labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
        if not isinstance(labels, Mapping) or labels.get(resources.NODE_LABEL) != self._label:
            self._gone(key)  # not for this node (any more)
            return None
        uid = metadata.get("uid") if isinstance(metadata, Mapping) else None
        uid = uid if isinstance(uid, str) else None
        spec = obj.get("spec")
        seen = _Seen(uid, json.dumps(spec, sort_keys=True, default=str))
        known = self._known.get(key)
        if known == seen:
            return key  # a status update, or a re-listing of an unchanged object
        if known is not None and known.uid != uid:
            self._gone(key)  # deleted and created again
        self._known[key] = seen
        try:
            plan = resources.parse_node_plan_object(obj)
            if plan.node != self.node_name:
                raise resources.NodePlanObjectError(
                    f"{resources.NODE_PLAN_KIND} {namespace}/{name}: spec.node is {plan.node!r}"
                    f" but the object is labelled {resources.NODE_LABEL}={self._label}"
                    f" (node {self.node_name!r})"
                )
        except resources.NodePlanObjectError as exc:
            log.error("%s; ignoring it", exc)
            revision = spec.get("revision") if isinstance(spec, Mapping) else None
            valid_revision = (
                revision if isinstance(revision, int) and not isinstance(revision, bool) else None
            )
            if self._on_invalid is not None:
                self._call(self._on_invalid, namespace, name, str(exc), valid_revision)
            return key
        self._call(self._on_plan, namespace, name, plan)
        return key

    def _gone(self, key: ObjectKey) -> None:
        if self._known.pop(key, None) is not None:
            self._call(self._on_delete, *key)

    def _call(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:
            log.exception("error in the node plan callback %s", getattr(callback, "__name__", ""))


def _creation_order(item: Mapping[str, Any]) -> tuple[str, str, str]:
    metadata = item.get("metadata")
    created = metadata.get("creationTimestamp") if isinstance(metadata, Mapping) else None
    namespace, name = resources.object_key(item)
    return (created if isinstance(created, str) else "", namespace, name)


def _lines(response: Any) -> Iterator[str]:
    """The lines of a streamed HTTP response, as they arrive."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=True):
        buffer += chunk if isinstance(chunk, bytes) else str(chunk).encode()
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line.decode("utf-8", errors="replace")
    if buffer.strip():
        yield buffer.decode("utf-8", errors="replace")


def _close(response: Any) -> None:
    for method in ("close", "release_conn"):
        fn = getattr(response, method, None)
        if callable(fn):
            try:
                fn()
            except Exception:
                log.debug("error while closing a response", exc_info=True)


# -- reports out -----------------------------------------------------------------------------------


class ReportWriter:
    """Writes node plan statuses (the ``status`` subresource), never raising.

    :meth:`submit` queues a status for a background thread (the latest one per object wins);
    :meth:`write` patches at once. A status equal to the last one written for the object is
    not sent again (:meth:`forget` an object when it is deleted). Each condition keeps its
    ``lastTransitionTime`` while its status stays the same.

    Args:
        api: A ``kubernetes.client.CustomObjectsApi``.
        attempts: Tries per write, for conflicts, throttling, server and connection errors.
        on_gone: Called with (namespace, name) when the object turns out not to exist.
        retry_delay_s: Delay before the second try; doubles with each further try.
        request_timeout_s: Timeout of each request.
    """

    def __init__(
        self,
        api: Any,
        *,
        attempts: int = 4,
        retry_delay_s: float = 0.5,
        request_timeout_s: float = 10.0,
        on_gone: Callable[[str, str], None] | None = None,
    ) -> None:
        self._api = api
        self._on_gone = on_gone
        self._attempts = max(1, attempts)
        self._retry_delay_s = retry_delay_s
        self._request_timeout_s = request_timeout_s
        self._lock = threading.Condition()
        self._pending: dict[ObjectKey, dict[str, Any]] = {}
        self._written: dict[ObjectKey, dict[str, Any]] = {}
        self._epochs: dict[ObjectKey, int] = {}  # bumped by forget()
        self._busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="perseus-reports", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is pending (for up to ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Queue ``status`` for the object (replacing one not written yet)."""
        with self._lock:
            self._pending[(namespace, name)] = dict(status)
            self._lock.notify_all()

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone: drop its pending status and what was written to it."""
        with self._lock:
            self._pending.pop((namespace, name), None)
            self._written.pop((namespace, name), None)
            self._epochs[(namespace, name)] = self._epochs.get((namespace, name), 0) + 1

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is pending; ``False`` if that took longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._pending or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return not (self._pending or self._busy)
                self._lock.wait(remaining)
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stop.is_set():
                    self._lock.wait()
                if not self._pending:
                    return
                key = next(iter(self._pending))
                status = self._pending.pop(key)
                self._busy = True
            try:
                self.write(*key, status)
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def write(self, namespace: str, name: str, status: Mapping[str, Any]) -> bool:
        """Patch the object's status now; ``True`` once written (or unchanged)."""
        key = (namespace, name)
        with self._lock:
            previous = self._written.get(key)
            epoch = self._epochs.get(key, 0)
        document = _with_transition_times(status, previous)
        if document == previous:
            return True
        delay = self._retry_delay_s
        for attempt in range(1, self._attempts + 1):
            try:
                self._api.patch_namespaced_custom_object_status(
                    resources.GROUP,
                    resources.VERSION,
                    namespace,
                    resources.NODE_PLAN_PLURAL,
                    name,
                    {"status": document},
                    _request_timeout=self._request_timeout_s,
                )
            except Exception as exc:
                code = http_status(exc)
                if code == 404:
                    log.debug("%s/%s is gone; its status is not written", namespace, name)
                    if self._on_gone is not None:
                        # A deletion the watch missed (e.g. between a list and the next watch):
                        # the plan must not stay applied.
                        self._on_gone(namespace, name)
                    return False
                retriable = code is None or code in _RETRIABLE_HTTP
                if not retriable or attempt == self._attempts or self._stop.is_set():
                    log.error(
                        "cannot write the status of %s %s/%s (try %d of %d): %s",
                        resources.NODE_PLAN_KIND,
                        namespace,
                        name,
                        attempt,
                        self._attempts,
                        describe_api_error(exc),
                    )
                    return False
                log.debug("status of %s/%s: %s; retrying", namespace, name, describe_api_error(exc))
                self._stop.wait(delay)
                delay *= 2
                continue
            with self._lock:
                if self._epochs.get(key, 0) == epoch:  # not forgotten meanwhile
                    self._written[key] = document
            return True
        return False  # pragma: no cover - the loop always returns


# -- this node's labels in (the GPU Operator's driver upgrade state) -------------------------------

NODE_POLL_S: Final = 5.0
"""How often :class:`NodeLabelSource` reads the node (a driver upgrade's states last minutes)."""


_NODE_RBAC_HINT: Final = " (the agent's service account needs get on nodes)"


def core_v1_api(api_client: Any) -> Any:
    """A ``kubernetes.client.CoreV1Api`` on ``api_client``."""
    from kubernetes import client

    return client.CoreV1Api(api_client)


class NodeLabelSource:
    """One label of this node, read every ``interval_s`` from a background thread:
    ``on_value(value)`` with its value (``None``: no such label, or no such node) at the first
    successful read and whenever it changes. Errors are logged and retried; callbacks that
    raise are logged. Needs RBAC: ``get`` on ``nodes``.

    Polling rather than watching: one small GET per interval, nothing to resume, and the
    upgrade states it follows last minutes.
    """

    def __init__(
        self,
        api: Any,
        node_name: str,
        label: str,
        on_value: Callable[[str | None], None],
        *,
        interval_s: float = NODE_POLL_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._api = api
        self.node_name = node_name
        self.label = label
        self._on_value = on_value
        self._interval_s = interval_s
        self._request_timeout_s = request_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="perseus-node", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def run(self) -> None:
        seen: tuple[str | None] | None = None  # nothing read yet
        failures = 0
        while not self._stop.is_set():
            try:
                node = self._api.read_node(self.node_name, _request_timeout=self._request_timeout_s)
                labels = getattr(getattr(node, "metadata", None), "labels", None) or {}
                value = labels.get(self.label)
            except Exception as exc:
                if http_status(exc) == 404:
                    value = None
                else:
                    failures += 1
                    (log.error if failures == 1 else log.debug)(
                        "cannot read node %s (for its label %s): %s%s; retrying every %.0f s",
                        self.node_name,
                        self.label,
                        describe_api_error(exc),
                        _NODE_RBAC_HINT if http_status(exc) == 403 else "",
                        self._interval_s,
                    )
                    self._stop.wait(self._interval_s)
                    continue
            failures = 0
            if seen is None or seen[0] != value:
                seen = (value,)
                try:
                    self._on_value(value)
                except Exception:
                    log.exception("error while handling label %s=%s", self.label, value)
            self._stop.wait(self._interval_s)


POD_LIST_TIMEOUT_S: Final = 5.0
"""Listing a node's pods runs on the TCP listener's accept path: it must fail fast."""


class NodePodLister:
    """Lists this node's pods (API JSON), for the TCP listener's address book
    (:mod:`perseus_agent.tcp_server`). Needs RBAC: ``list`` on ``pods`` in all namespaces (the
    field selector cannot be required by RBAC)."""

    def __init__(self, api: Any, node_name: str) -> None:
        self._api = api
        self.node_name = node_name

    def __call__(self) -> list[dict[str, Any]]:
        response = self._api.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}",
            _preload_content=False,
            _request_timeout=POD_LIST_TIMEOUT_S,
        )
        try:
            items = json.loads(response.data).get("items") or []
        finally:
            _close(response)
        return [item for item in items if isinstance(item, dict)]
