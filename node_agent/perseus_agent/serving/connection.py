"""One connection of a training process, from its first line to its close.

The server's accept loop (:mod:`perseus_agent.serving.local_server`) admits a connection and
reads until its first line; then :class:`RequestLoop` serves it on a thread of its own: reads
its requests line by line, hands each to :func:`~perseus_agent.serving.client_dispatch.dispatch`
and writes the reply, within the connection's deadlines (hello from the accept on, not per read;
then an idle timeout), and closes it after an oversized line, at EOF or on a send failure. Also
what both share of a connection: its record (:class:`Connection`), the peer's credentials and
the draining of unread input before a close.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Final

from perseus_agent.log_limit import RateLimitedLog
from perseus_agent.serving.client_dispatch import ClientHandler, ClientSession, dispatch
from perseus_client.protocol import MAX_MESSAGE_BYTES, encode_reply, error_reply

__all__ = [
    "DEFAULT_HELLO_TIMEOUT_S",
    "DEFAULT_IDLE_TIMEOUT_S",
    "RECV_BYTES",
    "Connection",
    "RequestLoop",
    "discard_input",
    "peer_credentials",
]

logger = logging.getLogger("perseus_agent.serving.local_server")  # the server's log, as before

DEFAULT_HELLO_TIMEOUT_S: Final = 10.0
"""A client sends hello right after connecting: this is seconds of slack for a loaded node."""
DEFAULT_IDLE_TIMEOUT_S: Final = 1800.0
"""Longer than any pause of a training loop between hooks but a checkpoint or an evaluation;
after one of those the client reconnects by itself (its GPUs are at default clocks meanwhile)."""
RECV_BYTES: Final = 65536
DISCARD_LIMIT_BYTES: Final = 1 << 20

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: Any) -> tuple[int | None, int | None, int | None]:
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None, None, None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, uid, gid = _PEERCRED.unpack(raw)
    except (OSError, struct.error):
        return None, None, None
    return int(pid), int(uid), int(gid)


@dataclass(eq=False)
class Connection:
    """One accepted connection, as the server's limits see it (:class:`socket_limits.Slot`)."""

    session: ClientSession
    sock: socket.socket
    thread: threading.Thread | None = None
    """``None`` until its first line: the accept loop reads that, so a connection that never
    sends one costs a file descriptor, not a thread."""
    buffer: bytes = b""
    """What the accept loop read, handed to the thread."""
    evicted: bool = False
    """Closed to make room for a newcomer (its thread, if any, is ending)."""

    @property
    def pending(self) -> bool:
        return self.session.hello is None

    @property
    def peer(self) -> Hashable:
        return self.session.peer

    @property
    def last_request_ns(self) -> int:
        return self.session.last_request_ns


def discard_input(sock: socket.socket) -> None:
    """Read (without blocking) and drop what the peer already sent, before closing.

    On Linux, closing a Unix socket that still holds unread input makes the peer's
    next read fail with ECONNRESET once it has read what was sent to it, instead of
    seeing end-of-file; a client must get the last reply and then a clean EOF.
    """
    with contextlib.suppress(OSError):  # BlockingIOError: nothing (more) to read
        sock.setblocking(False)
        discarded = 0
        while discarded < DISCARD_LIMIT_BYTES:
            data = sock.recv(RECV_BYTES)
            if not data:
                break
            discarded += len(data)


class RequestLoop:
    """Serves admitted connections (:meth:`serve`, on each connection's thread) with
    ``handler``. ``release(connection id, socket)`` closes a connection's socket when it ends,
    under the server's lock."""

    def __init__(
        self,
        handler: ClientHandler,
        hello_timeout_s: float,
        idle_timeout_s: float | None,
        limit_log: RateLimitedLog,
        release: Callable[[int, socket.socket], None],
    ) -> None:
        self.handler = handler
        self.hello_timeout_s = hello_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._limit_log = limit_log
        self._release = release

    def hello_deadline_s(self, session: ClientSession) -> float:
        """``time.monotonic()`` by which ``session`` must have said hello."""
        return session.connected_ns / 1e9 + self.hello_timeout_s

    def log_hello_timeout(self, session: ClientSession) -> None:
        self._limit_log.log(
            logging.INFO,
            "hello_timeout",
            "closing connection %d (pid %s): no hello within %.0f s",
            session.connection_id,
            session.peer_pid,
            self.hello_timeout_s,
        )

    def serve(self, sock: socket.socket, session: ClientSession, buffer: bytes) -> None:
        """Serve one connection until EOF, an oversized line, a send failure or stop();
        ``buffer`` is what the accept loop read of it."""
        cid = session.connection_id
        hello_deadline_s = self.hello_deadline_s(session)
        timeout_s: float | None = None  # of the socket now; blocking at accept
        try:
            while True:
                end = buffer.find(b"\n") + 1
                if not end:
                    if len(buffer) >= MAX_MESSAGE_BYTES:
                        self._oversized(sock, cid)
                        break
                    if session.hello is None:
                        # From the accept on, not per read: a drip of bytes gains nothing.
                        wanted_s: float | None = hello_deadline_s - time.monotonic()
                        if wanted_s is not None and wanted_s <= 0:
                            self.log_hello_timeout(session)
                            break
                    else:
                        wanted_s = self.idle_timeout_s
                    if wanted_s != timeout_s:  # a syscall-free attribute, but skip the call
                        sock.settimeout(wanted_s)
                        timeout_s = wanted_s
                    try:
                        data = sock.recv(RECV_BYTES)
                    except TimeoutError:
                        if session.hello is None:
                            continue  # the deadline check above logs and closes
                        self._limit_log.log(
                            logging.INFO,
                            "idle_timeout",
                            "closing connection %d (pid %s): no request for %.0f s",
                            cid,
                            session.peer_pid,
                            self.idle_timeout_s or 0.0,
                        )
                        break
                    if not data:
                        break  # EOF (a partial last line is dropped)
                    buffer += data
                    continue
                if end > MAX_MESSAGE_BYTES:
                    self._oversized(sock, cid)
                    break
                received_ns = time.monotonic_ns()
                session.last_request_ns = received_ns
                line, buffer = buffer[:end], buffer[end:]
                sock.sendall(dispatch(self.handler, session, line, received_ns))
        except OSError as exc:
            logger.debug("connection %d: %s", cid, exc)
        except Exception:  # pragma: no cover - dispatch catches the handler's exceptions
            logger.exception("connection %d failed", cid)
        finally:
            self._release(cid, sock)
            if session.hello is not None:
                self._disconnected(session)
            logger.debug("connection %d closed", cid)

    @staticmethod
    def _oversized(sock: socket.socket, cid: int) -> None:
        logger.warning("connection %d sent an oversized message; closing it", cid)
        sock.sendall(encode_reply(error_reply(f"message exceeds {MAX_MESSAGE_BYTES} bytes")))

    def _disconnected(self, session: ClientSession) -> None:
        try:
            self.handler.disconnected(session)
        except Exception:
            logger.exception("handler.disconnected failed for connection %d", session.connection_id)
