"""The plans of this node's jobs (Kubernetes mode): one applier per plan object.

:class:`JobPlans` applies every PerseusNodePlan of this node with its own
:class:`~perseus_agent.control.applier.PlanApplier`, keeps their GPUs disjoint
(:mod:`perseus_agent.plans.gpu_arbitration`), binds each to the GPUs its pods own
(:mod:`perseus_agent.ownership.gpu_ownership`), and routes each training process to the applier of
its job. The plans come from :mod:`perseus_agent.kube.plan_source`; their statuses
(:mod:`perseus_agent.plans.plan_status`) go out through :mod:`perseus_agent.kube.report_writer`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from perseus_agent.clocks.reset_state import ResetState
from perseus_agent.control.applier import PlanApplier
from perseus_agent.exporter import AgentMetrics, ManagedGpu
from perseus_agent.gpu.base import GpuBackend, GpuInfo
from perseus_agent.kube import ObjectKey
from perseus_agent.ownership.gpu_ownership import (
    Binding,
    LocalRankIndexOwnership,
    Ownership,
    PeerPod,
)
from perseus_agent.plans.gpu_arbitration import GpuGrant, arbitrate_gpus, restrict_plan
from perseus_agent.plans.plan_limits import plan_refusal
from perseus_agent.plans.plan_status import invalid_status, report_status
from perseus_agent.serving.client_dispatch import RequestError
from perseus_api import resources
from perseus_api.node_plan import NodePlan
from perseus_api.node_report import NodeReport

if TYPE_CHECKING:
    from perseus_agent.serving.client_dispatch import ClientSession
    from perseus_client.protocol import (
        HelloRequest,
        InstructionBeginRequest,
        InstructionEndRequest,
        StepBeginRequest,
        StepEndRequest,
    )

__all__ = ["JobPlans"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    plan: NodePlan
    """As bound to this node's GPUs (:mod:`perseus_agent.ownership.gpu_ownership`)."""
    applier: PlanApplier
    source: NodePlan | None = None
    """As the operator wrote it."""
    binding: Binding | None = None
    grant: GpuGrant | None = None
    """What was last applied (``None``: apply at the next reconciliation)."""
    error: str | None = None
    """Why the last apply failed, if it did."""
    refused: str | None = None
    """Why the plan object is refused whole (:mod:`perseus_agent.plans.plan_limits`)."""
    offered: NodePlan | None = None
    """The refused plan, offered again when another plan goes."""


class JobPlans:
    """The node plans of this node's jobs (Kubernetes mode): one applier per plan object.

    Every plan gets its own :class:`~perseus_agent.control.applier.PlanApplier` (sharing the
    backend, the reset record and the metrics). :func:`arbitrate_gpus` keeps their GPUs disjoint,
    the older plan winning; after every change the GPUs a plan loses are released before any plan
    locks the GPUs it gains.

    Every plan is first bound to the node's GPUs by ``ownership`` (default: process local
    rank = GPU index, trusted; the agent passes
    :class:`~perseus_agent.ownership.gpu_ownership.KubeletOwnership`): the assignments it refuses
    are reported ``Failed`` with the reason, and bound again at every :meth:`refresh_ownership`.

    Also the local server's handler: each training process is routed to the applier of its
    job — with kubelet ownership, the plan of its pod (told by ``ownership.peer_pod``; a
    process claiming GPUs its pod was not allocated is refused), and it drives only GPUs its
    pod owns; otherwise the plan naming its pod (a TCP peer: its address tells the pod), else
    the plan holding one of its GPUs (by UUID), else the plan of the job its hello names, else
    the only plan assigning its rank — and routed again whenever the plans change. A process
    no plan matches gets unmanaged replies (no clock).

    A plan object is refused whole (:mod:`perseus_agent.plans.plan_limits`: another namespace
    than its own, or too many plans on the node): no GPU is bound, its status says why.

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
            return {key: job.offered or job.source or job.plan for key, job in self._jobs.items()}

    def set_plan(self, key: ObjectKey, plan: NodePlan) -> list[ObjectKey]:
        """A plan object is new or changed: apply it. Returns the plans whose state changed."""
        with self._lock:
            job = self._jobs.get(key)
            others = sum(k != key and j.refused is None for k, j in self._jobs.items())
            refusal = plan_refusal(key, plan, others)
            if job is None:
                applier = PlanApplier(
                    self._backend, self._reset_state, self.node_name, self.metrics
                )
                job = self._jobs[key] = _Job(plan, applier)
            if refusal is not None:
                self._refuse(key, job, plan, refusal)
            else:
                job.refused = job.offered = None
                job.source, job.grant = plan, None
                self._bind(job, plan)
            return sorted({key, *self._reconcile()})

    def _refuse(self, key: ObjectKey, job: _Job, plan: NodePlan, refusal: str) -> None:
        """Hold ``job`` with no assignment (its GPUs reset, if it had any) and say why."""
        if job.refused != refusal:
            log.error("plan object %s/%s refused: %s", *key, refusal)
            self.metrics.count_error("invalid_plan")
        job.applier.clear()
        job.plan = plan.model_copy(update={"assignments": []})
        job.source = job.binding = job.grant = None
        job.refused, job.offered = refusal, plan

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
            retried = [k for k, j in self._jobs.items() if j.offered is not None]
            for other in retried:  # one may fit now (plans per node)
                offered = self._jobs[other].offered
                assert offered is not None
                self.set_plan(other, offered)
            return sorted({*retried, *self._reconcile()})

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
            if job is None or job.error is not None or job.refused is not None:
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
            if job.refused is not None:
                return invalid_status(job.refused, job.plan.revision)
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
        if session.verified_pod is not None:  # a TCP peer: its address says its pod
            pod_namespace, pod, _ = session.verified_pod
            for key, job in jobs:
                assert job.grant is not None
                if job.plan.namespace == pod_namespace and any(
                    a.pod == pod for a in job.grant.plan.assignments
                ):
                    return key
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


def _job_name(plan: NodePlan) -> str:
    return f"{plan.namespace}/{plan.job}"
