"""The agent's TCP listener: the client protocol at the node's address, for pods without volumes.

The Unix socket (:mod:`perseus_agent.serving.local_server`) needs a hostPath volume in the training
pod, which PodSecurity ``baseline`` and ``restricted`` refuse. The agent runs on the host
network, so it also listens on the node's address (``status.hostIP``); the operator's admission
webhook gives each pod of a managed workload ``PERSEUS_AGENT_ADDRESS=tcp://$(hostIP):PORT``
(:mod:`perseus_operator.webhook.injection`). Same protocol, same limits, same handler.

Who is calling. A Unix peer shows its pid (``SO_PEERCRED``); a TCP peer shows its source
address, which on a pod network is the pod's IP (no NAT between a pod and its own node).
:class:`PodAddressBook` maps it to the pod, from the API server's list of this node's pods, and
a connection is refused at once unless it comes from:

* a pod of this node (an address from elsewhere reaches the node's port too: refused);
* not on the host network (its address would be the node's, any host process's too);
* of a workload Perseus manages: labelled :data:`CLIENT_LABEL` by the webhook. The label
  grants nothing (the kubelet's allocation still decides which GPUs a pod may drive); it keeps
  unrelated pods from holding connection slots.

A hello naming another pod or namespace than the address's is refused; one naming none gets
the address's, and the GPU ownership check (:mod:`perseus_agent.ownership.gpu_ownership`) uses the
address's pod UID as it uses the cgroup's for a Unix peer. Per-peer limits count per pod
address. Spoofing a source address needs the return path too (TCP's handshake) on the node's
own pod network; the CNI's anti-spoofing rules, where there are any, stop even that.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

from perseus_agent.serving.client_dispatch import ClientHandler, ClientSession, RequestError
from perseus_agent.serving.local_server import LocalServer
from perseus_agent.serving.socket_file import LocalServerError
from perseus_client.protocol import HelloRequest

__all__ = [
    "CLIENT_LABEL",
    "DEFAULT_TCP_PORT",
    "PodAddress",
    "PodAddressBook",
    "TcpServer",
    "parse_listen_address",
    "pod_addresses",
]

log = logging.getLogger(__name__)

DEFAULT_TCP_PORT: Final = 7460
CLIENT_LABEL: Final = "perseus.energy/agent-client"
"""Set to ``"true"`` on the pods the operator's webhook injected."""
_LISTEN_BACKLOG: Final = 1024


@dataclass(frozen=True)
class PodAddress:
    """One pod of this node and an address of it."""

    ip: str
    namespace: str
    name: str
    uid: str
    host_network: bool
    client: bool
    """Labelled :data:`CLIENT_LABEL` ``"true"``."""


def pod_addresses(pod: Mapping[str, Any]) -> list[PodAddress]:
    """Every address of ``pod`` (the API's JSON form); none before it has one."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ips = [p.get("ip") for p in status.get("podIPs") or () if isinstance(p, Mapping)]
    if not ips and status.get("podIP"):
        ips = [status["podIP"]]
    labels = meta.get("labels") or {}
    return [
        PodAddress(
            ip=_normal(ip),
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            host_network=bool(spec.get("hostNetwork")),
            client=labels.get(CLIENT_LABEL) == "true",
        )
        for ip in ips
        if isinstance(ip, str) and ip
    ]


def _normal(ip: str) -> str:
    """One spelling per address (an IPv4-mapped IPv6 peer is its IPv4 address)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


class PodAddressBook:
    """Source address -> pod of this node, from ``list_pods`` (the pods of the node, API
    JSON), listed again at most every ``min_refresh_s`` when an address is unknown and at every
    lookup once the list is ``max_age_s`` old (addresses are reused after a pod ends).

    A failing list keeps the last one (logged); before any list every peer is refused.
    Thread-safe; a lookup that lists blocks only its caller (the accept loop, at most once per
    ``min_refresh_s``).
    """

    def __init__(
        self,
        node: str,
        list_pods: Callable[[], Sequence[Mapping[str, Any]]],
        *,
        min_refresh_s: float = 1.0,
        max_age_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self._list_pods = list_pods
        self.min_refresh_s = min_refresh_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_ip: dict[str, list[PodAddress]] = {}
        self._listed_at: float | None = None
        self._error: str | None = None

    def refresh(self) -> None:
        """List the node's pods now."""
        now = self._clock()
        try:
            pods = self._list_pods()
        except Exception as exc:  # the API is down: keep what we had, say why once
            self._error = f"{type(exc).__name__}: {exc}"
            log.warning("cannot list the pods of node %s: %s", self.node, self._error)
            self._listed_at = now
            return
        by_ip: dict[str, list[PodAddress]] = {}
        for pod in pods:
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):  # its address may already be another pod's
                continue
            for entry in pod_addresses(pod):
                by_ip.setdefault(entry.ip, []).append(entry)
        self._by_ip, self._listed_at, self._error = by_ip, now, None

    def resolve(self, ip: str) -> PodAddress:
        """The pod ``ip`` is; raises :class:`RequestError` saying why a peer is refused."""
        ip = _normal(ip)
        with self._lock:
            now = self._clock()
            listed_at = self._listed_at
            if (
                listed_at is None
                or now - listed_at >= self.max_age_s
                or (ip not in self._by_ip and now - listed_at >= self.min_refresh_s)
            ):
                self.refresh()
            found = list(self._by_ip.get(ip, ()))
            error = self._error
        pods = [p for p in found if not p.host_network]
        if not found:
            why = f" (cannot list its pods: {error})" if error else ""
            raise RequestError(f"{ip} is not the address of a pod on node {self.node}{why}")
        if not pods or len(pods) > 1:
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


def parse_listen_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 as ``[addr]:PORT``) -> ``(host, port)``; port 0: any free one."""
    host, sep, port_text = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 10.0.0.5:{DEFAULT_TCP_PORT}), got {text!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"{text!r}: HOST must be an IP address (the node's: $(HOST_IP) from status.hostIP)"
        ) from None
    return host, int(port_text)


class _PodCheckedHandler:
    """The server's handler, with each hello held to the pod the connection's address is."""

    def __init__(self, inner: ClientHandler) -> None:
        self._inner = inner

    def hello(
        self, session: ClientSession, msg: HelloRequest, received_ns: int
    ) -> Mapping[str, Any] | None:
        pod = session.verified_pod
        if pod is None:  # pragma: no cover - every TCP session is given its pod at accept
            raise RequestError("the agent could not tell which pod this connection comes from")
        namespace, name, _ = pod
        for key, actual in (("namespace", namespace), ("pod", name)):
            claimed = msg.get(key)
            if claimed not in (None, "", actual):
                log.warning(
                    "refused connection %d from %s: hello says %s %s, the address is pod %s/%s",
                    session.connection_id,
                    session.address,
                    key,
                    claimed,
                    namespace,
                    name,
                )
                raise RequestError(
                    f"the hello says {key} {claimed!r} but this connection comes from pod "
                    f"{namespace}/{name}"
                )
        msg["namespace"], msg["pod"] = namespace, name
        return self._inner.hello(session, msg, received_ns)

    def __getattr__(self, op: str) -> Any:  # every other request goes through as it is
        return getattr(self._inner, op)


class TcpServer(LocalServer):
    """Serve the client protocol on ``host:port`` (see the module); each peer must resolve to a
    pod through ``resolve`` (:meth:`PodAddressBook.resolve`). Limits as :class:`LocalServer`.
    ``port`` 0 takes a free port (:attr:`port` after :meth:`start`)."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: ClientHandler,
        resolve: Callable[[str], PodAddress],
        **limits: Any,
    ) -> None:
        parse_listen_address(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        super().__init__(
            Path(f"{host}:{port}"), cast(ClientHandler, _PodCheckedHandler(handler)), **limits
        )
        self.host = host
        self.port = port
        self._resolve = resolve

    @property
    def url(self) -> str:
        return (
            f"tcp://[{self.host}]:{self.port}"
            if ":" in self.host
            else f"tcp://{self.host}:{self.port}"
        )

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted agent must not wait out TIME_WAIT of its predecessor's connections.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(_LISTEN_BACKLOG)
        except OSError as exc:
            sock.close()
            raise LocalServerError(f"cannot listen on {self.host}:{self.port}: {exc}") from exc
        self.port = sock.getsockname()[1]
        self.socket_path = Path(f"{self.host}:{self.port}")  # for the log lines
        return sock

    def _new_session(self, sock: socket.socket, now_ns: int) -> ClientSession:
        try:
            ip = str(sock.getpeername()[0])
        except OSError as exc:
            raise RequestError(f"no peer address: {exc}") from None
        pod = self._resolve(ip)  # RequestError: refused with the reason
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return ClientSession(
            next(self._ids),
            None,
            None,
            None,
            now_ns,
            last_request_ns=now_ns,
            address=_normal(ip),
            verified_pod=(pod.namespace, pod.name, pod.uid),
        )
