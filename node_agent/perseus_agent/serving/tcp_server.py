"""The agent's TCP listener: the client protocol at the node's address, for pods without volumes.

The Unix socket (:mod:`perseus_agent.serving.local_server`) needs a hostPath volume in the training
pod, which PodSecurity ``baseline`` and ``restricted`` refuse. The agent runs on the host
network, so it also listens on the node's address (``status.hostIP``); the operator's admission
webhook gives each pod of a managed workload ``PERSEUS_AGENT_ADDRESS=tcp://$(hostIP):PORT``
(:mod:`perseus_operator.webhook.injection`). Same protocol, same limits, same handler.

Who is calling. A Unix peer shows its pid (``SO_PEERCRED``); a TCP peer shows its source
address, which on a pod network is the pod's IP (no NAT between a pod and its own node). The
caller's ``resolve`` (:class:`perseus_agent.ownership.node_pods.NodePods`: this node's pods as
the API server's watch says they are now) maps it to the pod, from memory: the accept loop never
waits on the API server, and a stranger costs no API call. A connection is refused at once
unless it comes from:

* a live pod of this node (an address from elsewhere reaches the node's port too: refused at
  its hello; an address not known at the accept is asked again then, for up to
  :data:`HELLO_RESOLVE_WAIT_S`, on the connection's thread, in case its pod just started);
* not on the host network (its address would be the node's, any host process's too);
* of a workload Perseus manages: labelled :data:`CLIENT_LABEL` by the webhook. The label
  grants nothing (the kubelet's allocation still decides which GPUs a pod may drive); it keeps
  unrelated pods from holding connection slots.

A hello naming another pod or namespace than the address's is refused; one naming none gets
the address's, and the GPU ownership check (:mod:`perseus_agent.ownership.gpu_ownership`) uses the
address's pod UID as it uses the cgroup's for a Unix peer. The identity is never older than the
pod it names: every request checks (``holds``, a lookup) that the address is still that pod's,
and once it is not (the pod ended and its IP went to another pod) the connection's requests are
refused. Per-peer limits count per pod address. Spoofing a source address needs the return path
too (TCP's handshake) on the node's own pod network; the CNI's anti-spoofing rules, where there
are any, stop even that.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
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
    "HELLO_RESOLVE_WAIT_S",
    "PodAddress",
    "PodResolver",
    "TcpServer",
    "UnknownAddressError",
    "normal_ip",
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
            ip=normal_ip(ip),
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            host_network=bool(spec.get("hostNetwork")),
            client=labels.get(CLIENT_LABEL) == "true",
        )
        for ip in ips
        if isinstance(ip, str) and ip
    ]


def normal_ip(ip: str) -> str:
    """One spelling per address (an IPv4-mapped IPv6 peer is its IPv4 address)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


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


_PER_REQUEST_OPS: Final = ("step_begin", "step_end", "instruction_begin", "instruction_end")


class UnknownAddressError(RequestError):
    """No pod of the node has this address, as far as the resolver knows now: its pod may have
    started a moment ago (its status not seen yet), so the hello asks again."""


PodResolver = Callable[[str, float], PodAddress]
"""``(ip, wait_s)`` -> the pod ``ip`` is; may wait up to ``wait_s`` for an unknown address to
become known; raises :class:`RequestError` (:class:`UnknownAddressError`) to refuse."""

HELLO_RESOLVE_WAIT_S: Final = 0.1
"""How long a hello from an address not known yet waits for it: within the client's reply
timeout (0.2 s), on the connection's own thread, never the accept loop's."""


class _PodCheckedHandler:
    """The server's handler, with each hello held to the pod the connection's address is, and
    every later request to that pod still being the address's (``holds``)."""

    def __init__(
        self,
        inner: ClientHandler,
        resolve: PodResolver,
        holds: Callable[[str, str], bool] | None,
    ) -> None:
        self._inner = inner
        self._resolve = resolve
        self._holds = holds
        self._revoked: set[int] = set()  # connection ids whose address changed hands

    def _check(self, session: ClientSession) -> None:
        pod, address = session.verified_pod, session.address
        if self._holds is None or pod is None or address is None:
            return
        if session.connection_id not in self._revoked:
            if self._holds(address, pod[2]):
                return
            self._revoked.add(session.connection_id)
            log.warning(
                "connection %d: %s is no longer the address of pod %s/%s (UID %s); its "
                "requests are refused from now on",
                session.connection_id,
                address,
                pod[0],
                pod[1],
                pod[2],
            )
            self._inner.disconnected(session)  # its GPUs go back to the plan's clocks
        raise RequestError(
            f"{address} is no longer the address of pod {pod[0]}/{pod[1]}: reconnect"
        )

    def hello(
        self, session: ClientSession, msg: HelloRequest, received_ns: int
    ) -> Mapping[str, Any] | None:
        pod = session.verified_pod
        if pod is None:  # an address unknown at the accept: known by now, or refused
            found = self._resolve(session.address or "", HELLO_RESOLVE_WAIT_S)
            pod = session.verified_pod = (found.namespace, found.name, found.uid)
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
        if self._holds is not None and not self._holds(session.address or "", pod[2]):
            raise RequestError(  # the address changed hands since the accept
                f"{session.address} is no longer the address of pod {namespace}/{name}: reconnect"
            )
        msg["namespace"], msg["pod"] = namespace, name
        return self._inner.hello(session, msg, received_ns)

    def disconnected(self, session: ClientSession) -> None:
        if session.connection_id in self._revoked:
            self._revoked.discard(session.connection_id)
            return  # told already
        self._inner.disconnected(session)

    def __getattr__(self, op: str) -> Any:
        method = getattr(self._inner, op)
        if op not in _PER_REQUEST_OPS:
            return method

        def checked(session: ClientSession, *args: Any) -> Any:
            self._check(session)
            return method(session, *args)

        return checked


class TcpServer(LocalServer):
    """Serve the client protocol on ``host:port`` (see the module); each peer must resolve to a
    pod through ``resolve`` (:meth:`perseus_agent.ownership.node_pods.NodePods.resolve`, which
    must not block), and each request after hello is refused once ``holds(address, pod UID)``
    says the address is no longer that pod's. Limits as :class:`LocalServer`. ``port`` 0 takes
    a free port (:attr:`port` after :meth:`start`)."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: ClientHandler,
        resolve: PodResolver,
        holds: Callable[[str, str], bool] | None = None,
        **limits: Any,
    ) -> None:
        parse_listen_address(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        super().__init__(
            Path(f"{host}:{port}"),
            cast(ClientHandler, _PodCheckedHandler(handler, resolve, holds)),
            **limits,
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
        try:  # from memory, never the API and never waiting: this is the accept loop
            pod: PodAddress | None = self._resolve(ip, 0.0)
        except UnknownAddressError:
            pod = None  # told at its hello, on its own thread (a pod that just started)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return ClientSession(
            next(self._ids),
            None,
            None,
            None,
            now_ns,
            last_request_ns=now_ns,
            address=normal_ip(ip),
            verified_pod=None if pod is None else (pod.namespace, pod.name, pod.uid),
        )
