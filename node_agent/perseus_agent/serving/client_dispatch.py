"""How a request of a training process reaches the agent's handler and becomes its reply.

The server side of the wire format :mod:`perseus_client.protocol`: the :class:`ClientSession`
of a connection, the :class:`ClientHandler` interface the agent's applier implements, the
event time of a request (:func:`event_time_ns`) and :func:`dispatch`, which decodes one
request line, calls the handler and encodes its reply. The transports
(:mod:`perseus_agent.serving.local_server`, :mod:`perseus_agent.serving.tcp_server`) only move
lines.

A malformed or unknown request gets an ``{"ok": false, "error": ...}`` reply; a handler
exception is logged and sent back as an error reply (no traceback for :class:`RequestError`).
Requests other than hello are refused before a successful hello.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from perseus_agent.errors import AgentError
from perseus_client.protocol import (
    OP_HELLO,
    OP_INSTRUCTION_BEGIN,
    PROTOCOL_VERSION,
    HelloRequest,
    InstructionBeginRequest,
    InstructionEndRequest,
    ProtocolError,
    StepBeginRequest,
    StepEndRequest,
    decode_request,
    encode_reply,
    error_reply,
)

__all__ = [
    "MAX_EVENT_AGE_NS",
    "ClientHandler",
    "ClientSession",
    "RequestError",
    "dispatch",
    "event_time_ns",
]

logger = logging.getLogger(__name__)


class RequestError(AgentError):
    """Raised by a handler to refuse a request: the message becomes the error reply, no traceback
    is logged (unlike any other exception)."""


@dataclass(eq=False)
class ClientSession:
    """One connection of a training process.

    Attributes:
        connection_id: Unique per server, increasing.
        peer_pid, peer_uid, peer_gid: Of the connecting process (``SO_PEERCRED``), as seen
            from the agent's PID and user namespaces (``None`` where unavailable). The pid
            the client reports in hello is in the container's namespace and may differ.
        connected_ns: ``time.monotonic_ns()`` at accept.
        hello: The accepted hello request (``None`` until then).
    """

    connection_id: int
    peer_pid: int | None
    peer_uid: int | None
    peer_gid: int | None
    connected_ns: int
    hello: HelloRequest | None = None
    last_request_ns: int = 0
    """``time.monotonic_ns()`` of the last request received (of the accept before one)."""
    address: str | None = None
    """A TCP peer's IP address (``None`` on the Unix socket)."""
    verified_pod: tuple[str, str, str] | None = None
    """``(namespace, name, uid)`` of the pod the transport says the peer is (a TCP peer's
    address: :mod:`perseus_agent.serving.tcp_server`), whatever its hello claims."""

    @property
    def peer(self) -> Hashable:
        """Whose connection this is, for the per-peer limits: ``(uid, pid)``, the pid ``None``
        when unknown or 0 (a process outside the agent's PID namespace); a TCP peer's pod
        address."""
        if self.address is not None:
            return ("address", self.address)
        return self.peer_uid, self.peer_pid or None

    @property
    def version(self) -> int:
        """The protocol version the connection speaks: its hello's (the newest before one)."""
        return PROTOCOL_VERSION if self.hello is None else self.hello["version"]

    @property
    def rank(self) -> int | None:
        return None if self.hello is None else self.hello["rank"]

    @property
    def local_rank(self) -> int | None:
        return None if self.hello is None else self.hello["local_rank"]

    @property
    def gpu_uuids(self) -> list[str]:
        return [] if self.hello is None else list(self.hello["gpu_uuids"])

    @property
    def client_pid(self) -> int | None:
        """The pid the client reported (its own PID namespace)."""
        return None if self.hello is None else self.hello["pid"]

    @property
    def job(self) -> str | None:
        return None if self.hello is None else self.hello["job"]

    @property
    def namespace(self) -> str | None:
        return None if self.hello is None else self.hello["namespace"]

    @property
    def pod(self) -> str | None:
        return None if self.hello is None else self.hello["pod"]


class ClientHandler(Protocol):
    """What the agent does with each request (implemented by the applier).

    Every method gets the session, the validated request and the request's
    event time (``time.monotonic_ns()`` clock: :func:`event_time_ns`). The returned
    mapping (or ``None``) is merged into the ``{"ok": true}`` reply. Raise
    :class:`RequestError` to refuse a request; any other exception is logged and reported
    as an error reply.
    Requests other than hello arrive only after a successful hello.
    """

    def hello(
        self, session: ClientSession, msg: HelloRequest, received_ns: int
    ) -> Mapping[str, Any] | None:
        """A training process announced itself (``session.hello`` is already ``msg``)."""

    def step_begin(
        self, session: ClientSession, msg: StepBeginRequest, received_ns: int
    ) -> Mapping[str, Any] | None: ...

    def step_end(
        self, session: ClientSession, msg: StepEndRequest, received_ns: int
    ) -> Mapping[str, Any] | None: ...

    def instruction_begin(
        self, session: ClientSession, msg: InstructionBeginRequest, received_ns: int
    ) -> Mapping[str, Any] | None:
        """Set the clock for this instruction; reply ``{"sm_clock_mhz": clock or None}``."""

    def instruction_end(
        self, session: ClientSession, msg: InstructionEndRequest, received_ns: int
    ) -> Mapping[str, Any] | None: ...

    def disconnected(self, session: ClientSession) -> None:
        """The connection closed; called once for each session whose hello succeeded."""


MAX_EVENT_AGE_NS: Final = 1_000_000_000
"""How far before its receipt a request's own ``t_ns`` may lie and still be taken."""


def event_time_ns(msg: Mapping[str, Any], received_ns: int) -> int:
    """When a request's event happened: its ``t_ns`` (the client's monotonic clock, the
    node's) when that lies within :data:`MAX_EVENT_AGE_NS` before the receipt, else the
    receipt. A client in another time namespace, or one that lies, times only its own GPU's
    profile, and by at most a second."""
    t_ns = msg.get("t_ns")
    if isinstance(t_ns, int) and received_ns - MAX_EVENT_AGE_NS <= t_ns <= received_ns:
        return t_ns
    return received_ns


def dispatch(
    handler: ClientHandler, session: ClientSession, line: bytes, received_ns: int
) -> bytes:
    """The encoded reply of ``handler`` to one request line of ``session``, received at
    ``received_ns`` (``time.monotonic_ns()``)."""
    cid = session.connection_id
    try:
        # Each connection speaks the version its hello named (hello itself: any).
        msg = decode_request(line, session.version)
    except ProtocolError as exc:
        logger.debug("connection %d: bad request: %s", cid, exc)
        return encode_reply(error_reply(str(exc)))
    op = msg["op"]
    if op == OP_HELLO:
        if session.hello is not None:
            return encode_reply(error_reply("hello already received on this connection"))
    elif session.hello is None:
        return encode_reply(error_reply(f"send hello before {op}"))

    method: Callable[[ClientSession, Any, int], Mapping[str, Any] | None]
    method = getattr(handler, op)
    if msg["op"] == OP_HELLO:
        session.hello = msg
    try:
        result = method(session, msg, event_time_ns(msg, received_ns))
        reply = dict(result) if result is not None else {}
    except RequestError as exc:
        return _refuse(session, op, str(exc))
    except Exception as exc:
        logger.exception("handler.%s failed for connection %d", op, cid)
        return _refuse(session, op, f"agent error in {op}: {type(exc).__name__}: {exc}")
    reply["ok"] = True
    if op == OP_HELLO:
        reply.setdefault("version", session.version)
        reply.setdefault("connection_id", cid)
    elif op == OP_INSTRUCTION_BEGIN:
        reply.setdefault("sm_clock_mhz", None)
    try:
        return encode_reply(reply, op)
    except ProtocolError as exc:
        logger.error("handler.%s returned an invalid reply %r: %s", op, reply, exc)
        return _refuse(session, op, f"agent produced an invalid reply to {op}")


def _refuse(session: ClientSession, op: str, message: str) -> bytes:
    if op == OP_HELLO:
        session.hello = None
    return encode_reply(error_reply(message))
