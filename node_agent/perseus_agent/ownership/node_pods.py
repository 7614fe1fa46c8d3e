"""This node's pods as the API server says they are now: who an address or a pod UID is.

:class:`NodePods` is fed by :class:`perseus_agent.kube.pod_watch.NodePodWatch` (a listing,
then every change) and answers, without any API call and without waiting:

* :meth:`NodePods.resolve`: which pod a TCP peer's address is
  (:mod:`perseus_agent.serving.tcp_server` refuses the peer otherwise, saying why);
* :meth:`NodePods.holds`: whether an address still is the pod a connection was taken for (a
  pod IP reused by another pod must not inherit the old pod's identity: the connection's
  requests are refused from then on);
* :meth:`NodePods.pod_of_uid`: which pod a UID is (a Unix peer's cgroup tells its pod UID;
  :mod:`perseus_agent.ownership.gpu_ownership` takes the pod's namespace and name from here,
  never from what a plan claims, so a plan cannot claim another tenant's pod, and a pod recreated
  under its old name, with a new UID, is still its job's).

An address is a pod's only while the pod is live: not terminating (``deletionTimestamp``) and not
ended (``Succeeded``/``Failed``), since its address may already be another pod's. Two live pods
with one address (a reuse the API has not caught up with) are refused: the agent cannot tell
which is calling. Host-network pods share the node's address and are refused over TCP.

Staleness. Until the first listing every peer is refused. When the watch is lost the view is
kept (pods are not scheduled onto the node without the API server either) for
``max_stale_s``; after that new TCP peers are refused, with the reason, until the API server is
back. Connections already verified go on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from perseus_agent.serving.client_dispatch import RequestError
from perseus_agent.serving.tcp_server import (
    CLIENT_LABEL,
    PodAddress,
    UnknownAddressError,
    normal_ip,
    pod_addresses,
)

__all__ = ["DEFAULT_MAX_STALE_S", "NodePods"]

log = logging.getLogger(__name__)

DEFAULT_MAX_STALE_S: Final = 60.0
"""How long without the API server the last view of the pods still admits new TCP peers."""

_ENDED: Final = ("Succeeded", "Failed")


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata")
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    return uid if isinstance(uid, str) else ""


def _kept(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the view reads of a pod (a pod's full JSON is tens of KB; a node runs ~100)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels")
    if not isinstance(labels, Mapping):
        labels = {}
    return {
        "metadata": {
            "namespace": meta.get("namespace"),
            "name": meta.get("name"),
            "uid": meta.get("uid"),
            "deletionTimestamp": meta.get("deletionTimestamp"),
            "labels": {CLIENT_LABEL: labels[CLIENT_LABEL]} if CLIENT_LABEL in labels else {},
        },
        "spec": {"hostNetwork": spec.get("hostNetwork")},
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "podIPs": status.get("podIPs"),
        },
    }


def _live(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return not meta.get("deletionTimestamp") and status.get("phase") not in _ENDED


class NodePods:
    """The pods of node ``node`` (API JSON), as last listed and watched. Thread-safe."""

    def __init__(
        self,
        node: str,
        *,
        max_stale_s: float = DEFAULT_MAX_STALE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.max_stale_s = max_stale_s
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pods: dict[str, Mapping[str, Any]] = {}  # by UID, the fields read (_kept)
        self._by_ip: dict[str, list[PodAddress]] = {}
        self._names: dict[str, tuple[str, str]] = {}  # UID -> namespace, name
        self._synced = False
        self._lost_since: float | None = None
        self._error: str | None = None

    # -- fed by the watch ----------------------------------------------------------------------

    def listed(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full listing of the node's pods."""
        with self._lock:
            self._pods = {_uid(p): _kept(p) for p in pods if _uid(p)}
            self._synced, self._lost_since, self._error = True, None, None
            self._index()
            self._changed.notify_all()

    def changed(self, kind: str, pod: Mapping[str, Any]) -> None:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``)."""
        uid = _uid(pod)
        if not uid:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = _kept(pod)
            self._lost_since, self._error = None, None
            self._index()
            self._changed.notify_all()

    def lost(self, message: str) -> None:
        """The API server cannot be listed or watched now."""
        with self._lock:
            if self._lost_since is None:
                self._lost_since = self._clock()
            self._error = message

    def _index(self) -> None:
        by_ip: dict[str, list[PodAddress]] = {}
        names: dict[str, tuple[str, str]] = {}
        for uid, pod in self._pods.items():
            meta = pod.get("metadata") or {}
            names[uid] = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            if _live(pod):
                for entry in pod_addresses(pod):
                    by_ip.setdefault(entry.ip, []).append(entry)
        self._by_ip, self._names = by_ip, names

    # -- read by the listeners and the ownership -------------------------------------------------

    def resolve(self, ip: str, wait_s: float = 0.0) -> PodAddress:
        """The pod ``ip`` is now; raises :class:`RequestError` saying why a peer is refused
        (:class:`UnknownAddressError`: no pod has it). An unknown address is waited for up to
        ``wait_s`` (a pod whose status the watch has not brought yet)."""
        ip = normal_ip(ip)
        deadline = time.monotonic() + wait_s
        with self._lock:
            while ip not in self._by_ip and self._staleness() is None:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    break
                self._changed.wait(left_s)
            found = list(self._by_ip.get(ip, ()))
            stale = self._staleness()
        if stale is not None:
            raise RequestError(stale)
        pods = [p for p in found if not p.host_network]
        if not found:
            raise UnknownAddressError(f"{ip} is not the address of a live pod on node {self.node}")
        if not pods or len(found) > 1:
            names = ", ".join(sorted(f"{p.namespace}/{p.name}" for p in found))
            raise RequestError(
                f"{ip} is the address of {names} on the host network, or of several pods: the "
                "agent cannot tell which; such pods reach the agent on its Unix socket"
            )
        pod = pods[0]
        if not pod.client:
            raise RequestError(
                f"pod {pod.namespace}/{pod.name} is not labelled {CLIENT_LABEL}=true: only pods "
                "of workloads Perseus manages (the operator's webhook labels them) reach the agent"
            )
        return pod

    def holds(self, ip: str, uid: str) -> bool:
        """Whether ``ip`` (as :func:`normal_ip` spells it: a connection's address) is still the
        address of pod ``uid`` alone (while the view is stale, what it last said). On every
        request's path: a lookup, no parsing."""
        with self._lock:
            found = self._by_ip.get(ip, ())
            return len(found) == 1 and found[0].uid == uid

    def pod_of_uid(self, uid: str) -> tuple[str, str] | None:
        """``(namespace, name)`` of the pod whose UID is ``uid``, if the view has it."""
        with self._lock:
            return self._names.get(uid)

    def _staleness(self) -> str | None:
        """Why the view is too old to admit a new peer, if it is (lock held)."""
        why = f" ({self._error})" if self._error else ""
        if not self._synced:
            return f"the agent has not listed the pods of node {self.node} yet{why}"
        if self._lost_since is None:
            return None
        age_s = self._clock() - self._lost_since
        if age_s <= self.max_stale_s:
            return None
        return (
            f"the agent cannot see the pods of node {self.node} for {age_s:.0f} s{why}: it "
            "cannot tell which pod an address is now, so it takes no new connection over TCP "
            "until the API server answers"
        )
