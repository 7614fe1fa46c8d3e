"""One exchange on an open agent connection, and how a failed one is told.

:mod:`perseus_client.client` owns the connection's state (when to connect, when to go
no-op, what to warn); this module owns the bytes: a request sent and its one-line reply read
within a time limit, whether a hello's refusal is about the protocol version, and the short
reason a failure is logged with. Standard library only (imported inside training processes).
"""

from __future__ import annotations

import socket
import time
from typing import Final

from perseus_client import protocol
from perseus_client.protocol import ProtocolError, Reply

MSG_NOSIGNAL: Final = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE, not SIGPIPE, on a dead agent


def roundtrip(sock: socket.socket, reply_timeout_s: float, data: bytes, op: str) -> Reply:
    """Send ``data`` and read the reply to ``op``, all within ``reply_timeout_s``.

    Raises:
        TimeoutError: No whole reply in time.
        ConnectionResetError: The agent closed the connection.
        ProtocolError: The reply is too long or malformed.
    """
    deadline = time.monotonic() + reply_timeout_s
    sock.settimeout(reply_timeout_s)
    sock.sendall(data, MSG_NOSIGNAL)
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no reply within {reply_timeout_s * 1000:.0f} ms")
        sock.settimeout(remaining)
        chunk = sock.recv(protocol.MAX_MESSAGE_BYTES)
        if not chunk:
            raise ConnectionResetError("agent closed the connection")
        buf += chunk
        if len(buf) > protocol.MAX_MESSAGE_BYTES:
            raise ProtocolError("reply too long")
    return protocol.decode_reply(buf, op)


def refuses_version(reply: Reply) -> bool:
    """Whether a hello's error reply refuses its protocol version (old agents say so too)."""
    return not reply["ok"] and str(reply["error"]).startswith(protocol.UNSUPPORTED_VERSION_ERROR)


def failure_reason(exc: BaseException) -> str:
    """A failed exchange in a few words, for the one warning per outage."""
    if isinstance(exc, TimeoutError):
        return str(exc) or "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
