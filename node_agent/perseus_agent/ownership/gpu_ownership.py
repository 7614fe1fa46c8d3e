"""Which GPUs of this node a job may touch: the ones the kubelet allocated to its pods.

Kubernetes mode. The operator's node plans name each GPU by the process on it (pod,
container, local rank; :mod:`perseus_api.node_plan`). :class:`KubeletOwnership` asks the
kubelet (:mod:`perseus_agent.ownership.pod_resources`) which ``nvidia.com/gpu`` devices it allocated
to that container and binds the assignment to the ``local_rank``-th of them in the node's GPU
order (NVML index: PCI bus order, the order CUDA enumerates the container's GPUs in). A GPU the
kubelet did not allocate to the job's pod is never touched: such an assignment is reported
``Failed`` with a reason (:data:`NOT_ALLOCATED`, ...), and so is one whose GPU Perseus cannot
own alone:

* a MIG device (id ``MIG-...``): its clocks are the whole GPU's, shared with the other
  instances (:data:`MIG_DEVICE`);
* a time-slicing replica (device plugin ids ``<uuid>::<n>``), or a GPU the kubelet lists for
  two pods: other pods run on it (:data:`SHARED_GPU`).

It also says which pod a training process on the agent's socket belongs to
(:meth:`KubeletOwnership.peer_pod`): from the peer's pid (``SO_PEERCRED``, host pid with
``hostPID``) through ``/proc/<pid>/cgroup`` to the pod UID, and from the node's pods as the API
server says (:mod:`perseus_agent.ownership.node_pods`) to its namespace and name; a TCP peer's
address tells the same (:mod:`perseus_agent.serving.tcp_server`). A plan then manages the pod if
it names it in its own namespace: the UIDs the plans carry are a fallback only (no pod list),
each plan's for its own namespace, so a pod recreated under its old name is still its job's and
a plan claiming another tenant's pod UID takes nothing from it. Without a pid (an agent outside
the host PID namespace), the pod the process names is checked against the kubelet. A process
is refused, with the reason, when it claims a GPU its pod was not allocated.

:class:`LocalRankIndexOwnership` is for clusters without a kubelet (the emulated test clusters:
the agents' flag ``--gpu-ownership=local-rank-index``): process ``local_rank`` of a pod runs on
GPU index ``local_rank``, trusted, as before kubelet ownership; never for shared nodes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from perseus_agent.control.applier import unresolved_gpu_report
from perseus_agent.gpu.base import GpuInfo
from perseus_agent.ownership.pod_resources import PodDevices, PodResourcesClient, PodResourcesError
from perseus_agent.serving.client_dispatch import ClientSession, RequestError
from perseus_api.node_plan import GpuAssignment, NodePlan
from perseus_api.node_report import GpuReport

__all__ = [
    "GPU_RESOURCE",
    "Binding",
    "KubeletOwnership",
    "LocalRankIndexOwnership",
    "Ownership",
    "PeerPod",
    "bind_to_allocations",
    "pod_uid_of_pid",
]

log = logging.getLogger(__name__)

GPU_RESOURCE: Final = "nvidia.com/gpu"
NOT_ALLOCATED: Final = "gpu_not_allocated"
MIG_DEVICE: Final = "mig_device"
SHARED_GPU: Final = "shared_gpu"
UNAVAILABLE: Final = "pod_resources_unavailable"
UNIDENTIFIED: Final = "gpu_unidentified"

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)
"""A pod's cgroup: ``.../kubepods/burstable/pod<uid>/<container>`` (cgroupfs driver) or
``.../kubepods-burstable-pod<uid with _>.slice/...`` (systemd driver)."""


@dataclass(frozen=True)
class Binding:
    """A plan with each assignment bound to a GPU of this node, or refused."""

    plan: NodePlan
    """The bound assignments only, each with the GPU's UUID and index."""
    denied: tuple[GpuReport, ...]
    """A ``Failed`` report (``reason: why``) for each refused assignment."""
    pending: bool = False
    """Some assignment may bind later (its pod has no allocation yet, or the kubelet could not
    be asked): bind again at the next refresh."""


@dataclass(frozen=True)
class PeerPod:
    """The pod a training process belongs to, and the GPUs of this node it owns."""

    namespace: str
    name: str
    gpu_uuids: frozenset[str]
    how: str
    """How the pod was told (for the log): ``cgroup``, ``address`` (TCP) or ``hello``."""


class Ownership(Protocol):
    """How the agent binds plans to GPUs and tells which pod a training process is."""

    verifies_peers: bool
    """Whether :meth:`peer_pod` says which pod a process is (else what it reports is trusted)."""

    def bind(self, plan: NodePlan, devices: Sequence[GpuInfo]) -> Binding: ...

    def peer_pod(
        self, session: ClientSession, plans: Sequence[NodePlan], devices: Sequence[GpuInfo]
    ) -> PeerPod | None:
        """``None``: no pod to check (the process is unmanaged, or ownership is trusted)."""
        ...


# -- pure binding ----------------------------------------------------------------------------------


def _denied(plan: NodePlan, a: GpuAssignment, reason: str, message: str) -> GpuReport:
    return unresolved_gpu_report(plan, a, f"{reason}: {message}")


def _sharing(pods: Sequence[PodDevices]) -> dict[str, list[str]]:
    """Device id -> the pods (``namespace/name``) the kubelet allocated it to."""
    holders: dict[str, list[str]] = {}
    for pod in pods:
        for device_id in dict.fromkeys(pod.device_ids(GPU_RESOURCE)):
            holders.setdefault(device_id, []).append(f"{pod.namespace}/{pod.name}")
    return holders


def _refusal(
    device_ids: Sequence[str], holders: Mapping[str, list[str]], pod: str
) -> tuple[str, str] | None:
    """Why the GPUs ``device_ids`` of ``pod`` cannot be managed, if they cannot."""
    for device_id in device_ids:
        if device_id.startswith("MIG-"):
            return MIG_DEVICE, (
                f"pod {pod} was allocated MIG device {device_id}; a MIG instance's SM clock "
                "is its whole GPU's, shared with the other instances, so Perseus leaves it alone"
            )
        if "::" in device_id:
            return SHARED_GPU, (
                f"pod {pod} was allocated {device_id}, a time-slicing replica of GPU "
                f"{device_id.split('::', 1)[0]}; other pods run on that GPU, so Perseus "
                "leaves its clock alone (request whole GPUs)"
            )
        others = [h for h in holders.get(device_id, ()) if h != pod]
        if others:
            return SHARED_GPU, (
                f"GPU {device_id} is allocated to pod {pod} and to {', '.join(others)}; "
                "Perseus changes the clock of a GPU only when one pod owns it"
            )
    return None


def bind_to_allocations(
    plan: NodePlan, pods: Sequence[PodDevices], devices: Sequence[GpuInfo]
) -> Binding:
    """Bind each assignment of ``plan`` to the GPU the kubelet allocated to its process
    (``pods``: the kubelet's ``List``), refusing everything else (see the module)."""
    by_uuid = {g.uuid: g for g in devices}
    holders = _sharing(pods)
    by_name = {(p.namespace, p.name): p for p in pods}
    bound: list[GpuAssignment] = []
    denied: list[GpuReport] = []
    pending = False
    for a in plan.assignments:
        where = f"{plan.namespace}/{a.pod}"
        pod = by_name.get((plan.namespace, a.pod or ""))
        if a.pod is None:
            denied.append(
                _denied(
                    plan,
                    a,
                    UNIDENTIFIED,
                    f"the assignment of GPU {a.gpu_label} names no pod; in Kubernetes mode a "
                    "GPU is managed only when the kubelet allocated it to the job's pod",
                )
            )
            continue
        if pod is None or not pod.device_ids(GPU_RESOURCE):
            pending = True
            state = "is not running on" if pod is None else "was allocated no nvidia.com/gpu on"
            denied.append(
                _denied(plan, a, NOT_ALLOCATED, f"pod {where} {state} node {plan.node} (kubelet)")
            )
            continue
        if a.container is not None and a.container not in pod.containers:
            denied.append(
                _denied(plan, a, NOT_ALLOCATED, f"pod {where} has no container {a.container}")
            )
            continue
        ids = pod.device_ids(GPU_RESOURCE, a.container)
        refusal = _refusal(ids, holders, where)
        if refusal is not None:
            denied.append(_denied(plan, a, *refusal))
            continue
        unknown = [i for i in ids if i not in by_uuid]
        if unknown:
            denied.append(
                _denied(
                    plan,
                    a,
                    NOT_ALLOCATED,
                    f"pod {where} was allocated {', '.join(unknown)}, not GPUs of this node's "
                    f"driver ({len(devices)} GPUs)",
                )
            )
            continue
        owned = sorted((by_uuid[i] for i in dict.fromkeys(ids)), key=lambda g: g.index)
        gpu = _pick(a, owned)
        if gpu is None:
            listed = ", ".join(f"{g.index} ({g.uuid})" for g in owned) or "none"
            denied.append(
                _denied(
                    plan,
                    a,
                    NOT_ALLOCATED,
                    f"GPU {a.gpu_label} is not one of the GPUs the kubelet allocated to pod "
                    f"{where}{'' if a.container is None else ' container ' + a.container}: "
                    f"{listed}",
                )
            )
            continue
        bound.append(a.model_copy(update={"gpu_uuid": gpu.uuid, "gpu_index": gpu.index}))
    restricted = plan.model_copy(update={"assignments": bound})
    return Binding(restricted, tuple(denied), pending)


def _pick(a: GpuAssignment, owned: Sequence[GpuInfo]) -> GpuInfo | None:
    """The GPU of ``owned`` (the pod's, by index) that ``a`` names, if it is one of them."""
    if a.gpu_uuid is not None:
        return next((g for g in owned if g.uuid == a.gpu_uuid), None)
    if a.local_rank is not None:
        return owned[a.local_rank] if a.local_rank < len(owned) else None
    return next((g for g in owned if g.index == a.gpu_index), None)


def pod_uid_of_pid(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The UID of the pod process ``pid`` runs in, from its cgroup; ``None`` when unknown
    (not in a pod, no such process, or a cgroup namespace that hides the path)."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        match = _POD_UID.search(line.rsplit(":", 1)[-1])
        if match:
            return match.group(1).replace("_", "-")
    return None


def _managed(plans: Sequence[NodePlan], namespace: object, name: str) -> bool:
    """Whether a plan of ``namespace`` names pod ``name``."""
    return any(
        p.namespace == namespace and any(a.pod == name for a in p.assignments) for p in plans
    )


class PodNames(Protocol):
    """This node's pods as the API server says (:class:`~perseus_agent.ownership.node_pods.
    NodePods`)."""

    def pod_of_uid(self, uid: str) -> tuple[str, str] | None: ...


# -- strategies ------------------------------------------------------------------------------------


class KubeletOwnership:
    """GPU ownership from the kubelet's PodResources API (see the module).

    Args:
        client: The kubelet's API.
        proc_root: Where peers' ``<pid>/cgroup`` are read (``/proc``; the agent needs
            ``hostPID`` for ``SO_PEERCRED`` to give host pids).
        pods: The node's pods as the API server says (a cgroup's pod UID -> the pod); without
            it, the plans' ``pod_uid`` (a pod recreated with a new UID is then unmanaged, and
            logged so).
    """

    verifies_peers = True

    def __init__(
        self,
        client: PodResourcesClient,
        proc_root: Path = Path("/proc"),
        pods: PodNames | None = None,
    ) -> None:
        self.client = client
        self.proc_root = proc_root
        self.pods = pods

    def bind(self, plan: NodePlan, devices: Sequence[GpuInfo]) -> Binding:
        try:
            pods = self.client.list()
        except PodResourcesError as exc:
            log.error("cannot bind plan %s/%s to GPUs: %s", plan.namespace, plan.job, exc)
            message = (
                f"{exc}; the agent manages only GPUs the kubelet allocated to the job's pods "
                "(mount the kubelet's pod-resources directory, or run the agent with "
                "--gpu-ownership=local-rank-index on clusters without a kubelet)"
            )
            denied = tuple(_denied(plan, a, UNAVAILABLE, message) for a in plan.assignments)
            return Binding(plan.model_copy(update={"assignments": []}), denied, pending=True)
        return bind_to_allocations(plan, pods, devices)

    def peer_pod(
        self, session: ClientSession, plans: Sequence[NodePlan], devices: Sequence[GpuInfo]
    ) -> PeerPod | None:
        hello = session.hello
        assert hello is not None
        claimed = [u for u in hello.get("gpu_uuids") or () if isinstance(u, str)]
        reported = hello.get("pod")
        known: tuple[str, str] | None
        if session.verified_pod is not None:  # a TCP peer: its address told the pod, now
            known, how = session.verified_pod[:2], "address"
        else:
            uid = pod_uid_of_pid(session.peer_pid, self.proc_root) if session.peer_pid else None
            known = None if uid is None else self._pod_of_uid(uid, hello, plans)
            how = "cgroup"
            if uid is not None and known is None:
                return None  # a pod no plan on this node manages
        if known is not None:
            namespace, name = known
            if not _managed(plans, namespace, name):
                return None  # a pod no plan on this node manages
            if reported and reported != name:
                raise self._refuse(
                    session,
                    f"the process says it runs in pod {reported} but its cgroup is pod "
                    f"{namespace}/{name}'s",
                )
        else:
            namespace, reported_name, how = self._reported_pod(hello, plans, claimed)
            if reported_name is None:
                return None
            name = reported_name
        pod = self._allocation(namespace, name)
        owned = frozenset(pod.device_ids(GPU_RESOURCE)) if pod is not None else frozenset()
        foreign = [u for u in claimed if u not in owned]
        if pod is None or foreign:
            allocated = ", ".join(sorted(owned)) or "none"
            what = (
                f"GPU(s) {', '.join(foreign)} are not allocated to pod {namespace}/{name}"
                if pod is not None
                else f"the kubelet runs no pod {namespace}/{name} on this node"
            )
            raise self._refuse(
                session,
                f"{what} (the kubelet allocated: {allocated}); a training process may drive "
                "only its own pod's GPUs",
            )
        uuids = {g.uuid for g in devices}
        return PeerPod(namespace, name, frozenset(owned & uuids), how)

    def _pod_of_uid(
        self, uid: str, hello: Mapping[str, object], plans: Sequence[NodePlan]
    ) -> tuple[str, str] | None:
        """The pod whose UID is ``uid``: as the API server says (the node's pods), else as the
        plans do, each plan for its own namespace only. A recreated pod (a new UID under the
        old name) is its job's all the same; a plan claiming another namespace's pod UID
        claims nothing the real pod's process would lose."""
        if self.pods is not None:
            actual = self.pods.pod_of_uid(uid)
            if actual is not None:
                return actual
        claims = sorted(
            {
                (p.namespace, a.pod)
                for p in plans
                for a in p.assignments
                if a.pod_uid == uid and a.pod is not None
            }
        )
        if len(claims) > 1:  # only a hand-edited plan makes two: the process says which
            claims = [c for c in claims if c[0] == hello.get("namespace")]
        if len(claims) == 1:
            return claims[0]
        reported, namespace = hello.get("pod"), hello.get("namespace")
        if isinstance(reported, str) and reported and _managed(plans, namespace, reported):
            log.warning(
                "a training process of pod UID %s says it is pod %s/%s, which a plan manages "
                "under another UID (the pod was recreated?): the agent cannot tell without its "
                "list of the node's pods (RBAC: list and watch on pods); it is not managed",
                uid,
                namespace,
                reported,
            )
        return None

    def _reported_pod(
        self, hello: Mapping[str, object], plans: Sequence[NodePlan], claimed: Sequence[str]
    ) -> tuple[str, str | None, str]:
        """The pod a process names (``POD_NAME``), else the one plan pod it can only be."""
        reported, namespace = hello.get("pod"), hello.get("namespace")
        pods = {(p.namespace, a.pod) for p in plans for a in p.assignments if a.pod is not None}
        if isinstance(reported, str) and reported:
            matches = sorted(
                ns for ns, name in pods if name == reported and namespace in (None, "", ns)
            )
            if matches:
                return matches[0], reported, "hello"
            return "", None, "hello"  # a pod no plan on this node manages
        if not claimed:
            return "", None, "hello"
        overlapping = []
        for ns, name in sorted(pods):
            pod = self._allocation(ns, name)
            owned = set(pod.device_ids(GPU_RESOURCE)) if pod is not None else set()
            if owned and set(claimed) <= owned:
                return ns, name, "hello"
            if owned & set(claimed):
                overlapping.append(f"{ns}/{name}")
        if overlapping:
            raise RequestError(
                f"cannot tell which pod owns GPU(s) {', '.join(claimed)}: the process names no "
                "pod (set POD_NAME and POD_NAMESPACE from the downward API) and no managed pod "
                f"of this node was allocated them all (some are {', '.join(overlapping)}'s)"
            )
        return "", None, "hello"  # no managed pod's GPUs: not a process Perseus manages

    def _allocation(self, namespace: str, name: str) -> PodDevices | None:
        try:
            return self.client.get(namespace, name)
        except PodResourcesError as exc:
            raise RequestError(f"cannot check the process's GPUs with the kubelet: {exc}") from None

    @staticmethod
    def _refuse(session: ClientSession, message: str) -> RequestError:
        log.warning(
            "refused training process (pid %s, connection %d): %s",
            session.peer_pid,
            session.connection_id,
            message,
        )
        return RequestError(message)


class LocalRankIndexOwnership:
    """No kubelet to ask (emulated clusters): process ``local_rank`` runs on GPU index
    ``local_rank``, and what a process reports is trusted. Assignments naming a UUID or index
    keep it."""

    verifies_peers = False

    def bind(self, plan: NodePlan, devices: Sequence[GpuInfo]) -> Binding:
        assignments = [
            a.model_copy(update={"gpu_index": a.local_rank})
            if a.gpu_uuid is None and a.gpu_index is None
            else a
            for a in plan.assignments
        ]
        return Binding(plan.model_copy(update={"assignments": assignments}), ())

    def peer_pod(
        self, session: ClientSession, plans: Sequence[NodePlan], devices: Sequence[GpuInfo]
    ) -> PeerPod | None:
        return None
