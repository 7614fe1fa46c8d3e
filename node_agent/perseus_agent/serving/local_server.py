"""The agent's end of the training-process socket (``perseus_client`` is the other end).

With ``Instruction`` granularity the training process reports each step and
each forward/backward over a Unix socket in a hostPath directory (default
``/run/perseus/agent.sock``); the agent, the only process allowed to touch the
GPU, switches the clock and replies with the clock now in effect. The wire
format is :mod:`perseus_client.protocol` (newline-delimited JSON, one reply per
request); this module serves it and hands each request to a
:class:`ClientHandler`, which the agent's applier implements
(:mod:`perseus_agent.serving.client_dispatch` decodes a request, calls the handler and encodes its
reply).

Access control: the socket is ``0o660``, reachable by its owner and ``socket_group`` only
(see :mod:`perseus_agent.serving.socket_file`).

Threading. One thread accepts connections (this module) and each connection gets a thread of
its own (at most ``max_connections``; :mod:`perseus_agent.serving.connection`), which reads the
connection's requests, calls the handler directly and writes each reply: calls for one session are
sequential (one request at a time, in order), calls for different sessions may
run concurrently, so a handler must be thread-safe. There is no hand-off
between threads on a request's path (a training hook waits for its reply, so
every thread wake-up is latency). Each request's event time is passed to the
handler for profiling: the ``t_ns`` the client stamped it with (:func:`event_time_ns`),
else its receipt time (``time.monotonic_ns()``, taken as soon as its line is read). On a
loaded 2-core node the receipt came ~0.3-1 ms after the event, which put the first part of
each computation's energy in the idle time before it (measured blocking power +10 %).

Limits. A process that can reach the socket must not lock the real training processes out,
so no connection holds a slot for free (see :class:`LocalServer` for the numbers):

* a connection must say hello within ``hello_timeout_s`` of connecting (a slow drip of bytes
  does not extend that), and is closed after ``idle_timeout_s`` without a request (a training
  process's client reconnects by itself at its next hook; :mod:`perseus_agent.serving.connection`);
* connections are capped per peer process (``SO_PEERCRED``) and in all, those without hello
  tighter, and older or idler connections make room for a newcomer
  (:mod:`perseus_agent.serving.socket_limits` has the rules and the default numbers).

Connections closed by these rules are logged at a limited rate.

Failures stay per connection: a malformed or unknown request gets an
``{"ok": false, "error": ...}`` reply and the connection stays usable; a line
longer than :data:`~perseus_client.protocol.MAX_MESSAGE_BYTES` gets an error
reply and that connection is closed; a handler exception is logged and sent
back as an error reply. Nothing a client sends stops the server.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import select
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from perseus_agent.log_limit import RateLimitedLog
from perseus_agent.serving.client_dispatch import (
    ClientHandler,
    ClientSession,
    RequestError,
)
from perseus_agent.serving.connection import (
    DEFAULT_HELLO_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    RECV_BYTES,
    Connection,
    RequestLoop,
    discard_input,
    peer_credentials,
)
from perseus_agent.serving.socket_file import (
    DEFAULT_SOCKET_MODE,
    MAX_SOCKET_PATH_BYTES,
    LocalServerError,
    SocketId,
    bind_unix_socket,
    unlink_socket,
)
from perseus_agent.serving.socket_limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_PENDING_PER_PEER,
    Limits,
    make_room,
)
from perseus_client.protocol import MAX_MESSAGE_BYTES, encode_reply, error_reply

__all__ = ["LocalServer"]

logger = logging.getLogger(__name__)

_ACCEPT_RETRY_S: Final = 1.0
_ACCEPT_BATCH: Final = 64


class LocalServer:
    """Serve the client protocol on a Unix socket, in background threads.

    Args:
        socket_path: Where to listen; its directory is created (``0o750``, group
            ``socket_group``) if missing. An existing directory (e.g. a hostPath the
            kubelet created) is left as it is: training pods must be able to traverse it.
        handler: Receives every valid request.
        socket_mode: Mode of the socket file; only owner and group bits are sensible.
        socket_group: Group id given to the socket (and to a directory it creates);
            training pods need it as a supplementary group. ``None``: the agent's group.
        max_connections: All connections together (each has a thread of its own; a node runs
            at most a few dozen training processes). When they are all taken a newcomer
            replaces a connection that has not said hello, or the longest-idle connection
            of the peer holding the most (if that holds more than the newcomer's peer),
            else it gets an error reply and is closed.
        hello_timeout_s: A connection that has not said hello this long after connecting is
            closed.
        idle_timeout_s: A connection without a request for this long is closed; ``None``:
            never.
        max_pending: Connections that have not said hello yet, in all; the oldest is closed
            to make room for a new one.
        max_pending_per_peer: The same, per peer process.
        max_connections_per_peer: Connections of one peer process; further ones are refused
            (after closing that peer's oldest connection without hello, if any).

    A stale socket left at ``socket_path`` by a crashed agent is removed; a live one
    (something accepts connections there) or a file that is not a socket is an error.
    """

    def __init__(
        self,
        socket_path: Path,
        handler: ClientHandler,
        *,
        socket_mode: int = DEFAULT_SOCKET_MODE,
        socket_group: int | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
        idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER,
        max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER,
    ) -> None:
        self.limits = Limits(
            max_connections=max_connections,
            max_pending=max_pending,
            max_pending_per_peer=max_pending_per_peer,
            max_connections_per_peer=max_connections_per_peer,
        )  # raises ValueError for a limit under 1
        if not hello_timeout_s > 0 or (idle_timeout_s is not None and not idle_timeout_s > 0):
            raise ValueError("hello_timeout_s and idle_timeout_s must be positive")
        if socket_mode & ~0o777:
            raise ValueError(f"socket_mode {socket_mode:#o} has bits beyond 0o777")
        if socket_mode & 0o007:
            logger.warning(
                "socket mode %#o lets every local user change GPU clocks; prefer %#o",
                socket_mode,
                DEFAULT_SOCKET_MODE,
            )
        self.socket_path = Path(socket_path)
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"socket path {str(self.socket_path)!r} is longer than "
                f"{MAX_SOCKET_PATH_BYTES} bytes, the AF_UNIX limit"
            )
        self.handler = handler
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._limit_log = RateLimitedLog(logger)
        self._requests = RequestLoop(
            handler, hello_timeout_s, idle_timeout_s, self._limit_log, self._release
        )

        self._thread: threading.Thread | None = None  # the accept loop
        self._listener: socket.socket | None = None
        self._wake_fds: tuple[int, int] | None = None  # pipe that interrupts the accept loop
        self._stopping = threading.Event()
        self._socket_id: SocketId | None = None  # (st_dev, st_ino) of our socket file
        self._ids = itertools.count(1)
        # Guards _connections; a connection's socket is shut down or closed only under it.
        self._lock = threading.Lock()
        self._connections: dict[int, Connection] = {}
        # Accept thread only: connections waiting for their first line, by file descriptor.
        self._waiting: dict[int, Connection] = {}
        self._poller: Any = None  # select.poll of the accept loop

    # -- lifecycle

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def sessions(self) -> list[ClientSession]:
        """The open connections, oldest first."""
        with self._lock:
            return [conn.session for conn in self._connections.values()]

    def start(self) -> None:
        """Create the socket and start serving; raises :class:`LocalServerError` if it cannot."""
        if self._thread is not None:
            raise RuntimeError("LocalServer already started")
        listener = self._bind()
        try:
            listener.setblocking(False)
            self._wake_fds = os.pipe()
        except OSError as exc:
            listener.close()
            self._unlink_socket()
            raise LocalServerError(f"cannot serve on {self.socket_path}: {exc}") from exc
        self._listener = listener
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._accept_loop,
            args=(listener, self._wake_fds[0]),
            name="perseus-local-server",
            daemon=True,
        )
        self._thread.start()
        logger.info("serving Perseus clients on %s", self.socket_path)

    def stop(self, timeout: float = 5.0) -> None:
        """Close every connection, stop serving and remove the socket file. Idempotent.

        Waits (up to ``timeout`` in all) for the connections' threads to end, that is
        for running handler calls and the ``disconnected()`` calls.
        """
        thread = self._thread
        if thread is None:
            return
        current = threading.current_thread()
        with self._lock:
            own = current is thread or any(c.thread is current for c in self._connections.values())
        if own:
            raise RuntimeError("LocalServer.stop() called from one of the server's own threads")
        deadline = time.monotonic() + timeout
        self._stopping.set()
        if self._wake_fds is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_fds[1], b"\0")
        thread.join(timeout)
        if thread.is_alive():  # pragma: no cover - the accept loop does not block elsewhere
            logger.warning("local server thread did not stop within %.1f s", timeout)
        if self._listener is not None:
            self._listener.close()  # no new connections from here on
            self._listener = None
        with self._lock:
            connections = list(self._connections.values())
            for conn in connections:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)  # unblocks its thread's recv/send
        for conn in connections:
            if conn.thread is None:  # pragma: no cover - the accept loop closed those
                continue
            conn.thread.join(max(0.0, deadline - time.monotonic()))
            if conn.thread.is_alive():
                logger.warning(
                    "connection %d still busy in the handler after %.1f s; not waiting for it",
                    conn.session.connection_id,
                    timeout,
                )
        if self._wake_fds is not None:
            for fd in self._wake_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_fds = None
        self._unlink_socket()
        self._thread = None

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- socket file

    def _bind(self) -> socket.socket:
        sock, self._socket_id = bind_unix_socket(
            self.socket_path, self.socket_mode, self.socket_group
        )
        return sock

    def _unlink_socket(self) -> None:
        if self._socket_id is None:
            return
        unlink_socket(self.socket_path, self._socket_id)
        self._socket_id = None

    # -- connections

    def _accept_loop(self, listener: socket.socket, wake_fd: int) -> None:
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        poller.register(wake_fd, select.POLLIN)
        self._poller = poller
        listener_fd = listener.fileno()
        try:
            while not self._stopping.is_set():
                ready = poller.poll(self._poll_timeout_ms())
                if self._stopping.is_set() or any(fd == wake_fd for fd, _ in ready):
                    break
                for fd, _ in ready:
                    conn = self._waiting.get(fd)
                    if conn is not None:
                        self._read_first_line(conn)
                if any(fd == listener_fd for fd, _ in ready):
                    self._accept_pending(listener)
                self._expire_waiting()
        except Exception:  # pragma: no cover - logged, the thread just ends
            logger.exception("local server accept loop failed")
        finally:
            for conn in list(self._waiting.values()):
                self._close_waiting(conn)

    def _poll_timeout_ms(self) -> int | None:
        """Until the first hello deadline of a waiting connection; ``None``: no deadline."""
        if not self._waiting:
            return None
        first_s = min(self._requests.hello_deadline_s(c.session) for c in self._waiting.values())
        return max(0, math.ceil((first_s - time.monotonic()) * 1000))

    def _accept_pending(self, listener: socket.socket) -> None:
        # A bounded batch: under a flood of connections the ones already accepted must still
        # get their first line read (a real client's hello among them).
        for _ in range(_ACCEPT_BATCH):
            if self._stopping.is_set():
                return
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # out of file descriptors, ...: the client waits in the backlog
                logger.warning("cannot accept a connection on %s: %s", self.socket_path, exc)
                self._stopping.wait(_ACCEPT_RETRY_S)
                return
            self._admit(sock)

    def _new_session(self, sock: socket.socket, now_ns: int) -> ClientSession:
        """The session of a connection just accepted; raise :class:`RequestError` to refuse
        it (another transport tells its peers apart differently)."""
        pid, uid, gid = peer_credentials(sock)
        return ClientSession(next(self._ids), pid, uid, gid, now_ns, last_request_ns=now_ns)

    def _admit(self, sock: socket.socket) -> None:
        now_ns = time.monotonic_ns()
        try:
            session = self._new_session(sock, now_ns)
        except RequestError as exc:
            self._limit_log.warning("refuse_peer", "refusing a connection: %s", exc)
            self._refuse_connection(sock, str(exc))
            return
        pid, uid = session.peer_pid, session.peer_uid
        cid = session.connection_id
        conn = Connection(session, sock)
        with self._lock:
            live = [c for c in self._connections.values() if not c.evicted]  # oldest first
            victims, refusal = make_room(live, session.peer, self.limits)
            for victim in victims:
                victim.evicted = True
                if victim.thread is not None:
                    with contextlib.suppress(OSError):
                        victim.sock.shutdown(socket.SHUT_RDWR)  # its thread closes it
            if refusal is None:
                self._connections[cid] = conn
        for victim in victims:
            v = victim.session
            self._limit_log.warning(
                "evict",
                "closing connection %d (pid %s, uid %s, %s) to make room for connection %d",
                v.connection_id,
                v.peer_pid,
                v.peer_uid,
                "no hello yet" if victim.pending else "idle",
                cid,
            )
            if victim.thread is None:
                self._close_waiting(victim)
        if refusal is not None:
            self._limit_log.warning(
                "refuse", "refusing connection %d (pid %s, uid %s): %s", cid, pid, uid, refusal
            )
            self._refuse_connection(sock, refusal)
            return
        try:
            sock.setblocking(False)
            self._poller.register(sock, select.POLLIN)
        except OSError as exc:
            logger.error("cannot serve connection %d (pid %s): %s", cid, pid, exc)
            with self._lock:
                self._connections.pop(cid, None)
            sock.close()
            return
        self._waiting[sock.fileno()] = conn
        logger.debug("connection %d from pid %s uid %s", cid, pid, uid)

    def _read_first_line(self, conn: Connection) -> None:
        """Read what a waiting connection sent; give it a thread of its own once a line (or
        more than a line's worth) is in."""
        try:
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_waiting(conn)  # EOF before any line: nothing to answer
            return
        conn.buffer += data
        if b"\n" in conn.buffer or len(conn.buffer) >= MAX_MESSAGE_BYTES:
            self._start_thread(conn)

    def _start_thread(self, conn: Connection) -> None:
        cid = conn.session.connection_id
        del self._waiting[conn.sock.fileno()]
        self._poller.unregister(conn.sock)
        thread = threading.Thread(
            target=self._requests.serve,
            args=(conn.sock, conn.session, conn.buffer),
            name=f"perseus-client-{cid}",
            daemon=True,
        )
        conn.buffer = b""
        with self._lock:
            conn.thread = thread  # from here on its socket is its thread's
        try:
            conn.sock.setblocking(True)
            thread.start()
        except (OSError, RuntimeError) as exc:  # RuntimeError: can't start new thread
            logger.error("cannot serve connection %d: %s", cid, exc)
            with self._lock:
                self._connections.pop(cid, None)
                conn.thread = None
            self._refuse_connection(conn.sock, "the agent cannot serve another connection now")

    def _expire_waiting(self) -> None:
        now_s = time.monotonic()
        for conn in list(self._waiting.values()):
            if now_s >= self._requests.hello_deadline_s(conn.session):
                self._requests.log_hello_timeout(conn.session)
                self._close_waiting(conn)

    def _close_waiting(self, conn: Connection) -> None:
        """Close a connection that has no thread (accept thread only)."""
        fd = conn.sock.fileno()
        if self._waiting.pop(fd, None) is not None:
            with contextlib.suppress(OSError, KeyError, ValueError):
                self._poller.unregister(fd)
        with self._lock:
            self._connections.pop(conn.session.connection_id, None)
            discard_input(conn.sock)
            conn.sock.close()

    def _release(self, cid: int, sock: socket.socket) -> None:
        """A connection's thread is done with it: forget it and close its socket."""
        with self._lock:
            self._connections.pop(cid, None)
            discard_input(sock)
            sock.close()

    @staticmethod
    def _refuse_connection(sock: socket.socket, message: str) -> None:
        with contextlib.suppress(OSError):
            sock.setblocking(False)  # never let a client block the accept loop
            sock.send(encode_reply(error_reply(message)))
        discard_input(sock)
        sock.close()
