"""Client side of the agent socket: hooks a training process calls at each step and instruction.

The client never raises into training and never needs privileges. When the
agent is missing, refuses, is too slow or answers garbage, the client logs one
warning (logger ``perseus_client``) and its hooks become no-ops that return at
once; it tries to reconnect at most every ``retry_interval_s`` seconds, so a
restarted agent is picked up. It logs one warning per outage, not per call.

Two ways to talk to the agent:

* synchronous (default): each hook waits for the agent's reply, so
  :meth:`PerseusClient.on_instruction_begin` returns the SM clock now in effect;
  a hook costs one socket round trip.
* ``pipelined=True``: hooks send their request and return without waiting; the
  replies are read, without blocking, at later hooks (errors are logged as in
  synchronous mode). A hook then costs about one ``send`` system call, and
  ``on_instruction_begin`` returns ``None``. The agent still applies each clock
  in order, a fraction of a millisecond after the hook returns: the same
  fire-and-forget model as a frequency controller fed through a queue. At most
  ``max_outstanding`` replies may be pending; a hook that would exceed that waits
  for the oldest (up to ``reply_timeout_s``), so a stuck agent is detected and
  dropped as in synchronous mode.

Protocol versions: the client says hello with the newest version
(:data:`~perseus_client.protocol.PROTOCOL_VERSION`, 2). An older agent that refuses it gets a
version-1 hello on the same connection, unless the client was made with
``needs_protocol_version=2`` (a schedule with chunks or split backwards: what
:func:`perseus_client.torch.attach` sets for interleaved and zero-bubble schedules); then the
agent counts as unavailable, with a warning saying to upgrade it, and is tried again every
``retry_interval_s``. On a version-1 connection, a hook naming a chunk other than 0 or a split
backward is not sent (one warning): version 1 cannot say it.

This module owns one connection's state and the hooks' methods. The bytes of one exchange are
in :mod:`perseus_client.wire`, the replies a pipelined connection awaits in
:mod:`perseus_client.pending_replies`, connecting in :mod:`perseus_client.transport`, the
identity read from the environment in :mod:`perseus_client.identity`, and the process-wide
client behind the module-level hooks in :mod:`perseus_client.default_client`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import Any, Final

from perseus_client import protocol, transport
from perseus_client.identity import env_int, env_str, gpu_uuids_from_env
from perseus_client.pending_replies import PendingReplies
from perseus_client.protocol import ProtocolError, Reply
from perseus_client.wire import failure_reason, refuses_version, roundtrip

logger = logging.getLogger("perseus_client")

DEFAULT_CONNECT_TIMEOUT_S: Final = 0.05
DEFAULT_REPLY_TIMEOUT_S: Final = 0.2
DEFAULT_RETRY_INTERVAL_S: Final = 30.0
DEFAULT_MAX_OUTSTANDING: Final = 64


class PerseusClient:
    """Connection of one training process to the node agent.

    Args:
        socket_path: The agent's socket path, or ``tcp://HOST:PORT``; default
            ``$PERSEUS_AGENT_ADDRESS``, else ``$PERSEUS_AGENT_SOCKET``, else
            ``/run/perseus/agent.sock`` (:mod:`perseus_client.transport`). A malformed
            address raises :class:`~perseus_client.transport.AddressError`.
        rank, local_rank: Default ``$RANK``, ``$LOCAL_RANK``.
        gpu_uuids: Default from ``$NVIDIA_VISIBLE_DEVICES`` / ``$CUDA_VISIBLE_DEVICES``.
        job, namespace, pod: Default ``$PERSEUS_JOB``, ``$POD_NAMESPACE``, ``$POD_NAME``.
        connect_timeout_s: Limit on connecting.
        reply_timeout_s: Limit on each round trip (send and reply).
        retry_interval_s: Least time between two connection attempts.
        synchronize: Called before each instruction hook while connected, e.g.
            ``torch.cuda.synchronize``, so that a clock change lines up with the
            GPU work instead of the CPU's run-ahead. Not called while disconnected.
        pipelined: Send hooks without waiting for their replies (see the module
            docstring); ``on_instruction_begin`` then returns ``None``.
        max_outstanding: With ``pipelined``, the most replies that may be pending.
        needs_protocol_version: The oldest protocol version the hooks can be said in: 2 when
            they name chunks or split backwards (the agent must then speak it), else 1.

    Thread-safe: hooks from several threads are serialized. Connects lazily, at
    the first hook. After :meth:`close` every hook is a no-op.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        rank: int | None = None,
        local_rank: int | None = None,
        gpu_uuids: list[str] | None = None,
        job: str | None = None,
        namespace: str | None = None,
        pod: str | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S,
        synchronize: Callable[[], object] | None = None,
        pipelined: bool = False,
        max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
        needs_protocol_version: int = 1,
    ) -> None:
        if max_outstanding < 1:
            raise ValueError(f"max_outstanding must be at least 1, got {max_outstanding}")
        if needs_protocol_version not in protocol.SUPPORTED_VERSIONS:
            raise ValueError(
                f"needs_protocol_version must be one of {protocol.SUPPORTED_VERSIONS}, "
                f"got {needs_protocol_version!r}"
            )
        env = os.environ
        self.address = (
            transport.address_from_env(env)
            if socket_path is None
            else transport.parse_address(os.fspath(socket_path))
        )
        self.socket_path: str = str(self.address)
        self.rank = rank if rank is not None else env_int(env, "RANK")
        self.local_rank = local_rank if local_rank is not None else env_int(env, "LOCAL_RANK")
        self.gpu_uuids = list(gpu_uuids) if gpu_uuids is not None else gpu_uuids_from_env(env)
        self.job = job if job is not None else env_str(env, "PERSEUS_JOB")
        self.namespace = namespace if namespace is not None else env_str(env, "POD_NAMESPACE")
        self.pod = pod if pod is not None else env_str(env, "POD_NAME")
        self.connect_timeout_s = connect_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.retry_interval_s = retry_interval_s
        self.synchronize = synchronize
        self.pipelined = pipelined
        self.max_outstanding = max_outstanding
        self.needs_protocol_version = needs_protocol_version

        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_attempt = 0.0  # monotonic seconds; 0: connect at the first hook
        self._closed = False
        self._outage_warned = False  # one warning per outage
        self._error_reply_warned = False  # one warning per connection
        self._misuse_warned = False
        self._connections = 0
        self._version: int | None = None  # of the open connection
        self._old_agent_warned = False
        self._pending = PendingReplies()  # pipelined mode
        _clients.add(self)

    # -- state

    @property
    def connected(self) -> bool:
        """Whether a connection to the agent is open (it may have died since the last hook)."""
        return self._sock is not None

    @property
    def protocol_version(self) -> int | None:
        """The protocol version of the open connection (``None``: none open)."""
        return self._version

    @property
    def connections(self) -> int:
        """How many times a connection was established (reconnects included)."""
        return self._connections

    # -- hooks

    def on_step_begin(self, step: int) -> None:
        self._call(protocol.step_begin_request, step)

    def on_step_end(self, step: int) -> None:
        self._call(protocol.step_end_request, step)

    def on_instruction_begin(
        self, name: str, microbatch: int | None = None, chunk: int | None = None
    ) -> int | None:
        """Announce a computation (``forward``, ``backward``, ``backward_input`` or
        ``backward_weight``) of ``microbatch`` on the rank's ``chunk`` (its virtual stage,
        ``0..V-1``; ``None`` with one); returns the SM clock now in effect (``None``:
        unknown)."""
        reply = self._call(
            protocol.instruction_begin_request, name, microbatch, chunk, sync=True, versioned=True
        )
        clock = None if reply is None else reply.get("sm_clock_mhz")
        return clock if isinstance(clock, int) and not isinstance(clock, bool) else None

    def on_instruction_end(self, name: str, chunk: int | None = None) -> None:
        self._call(protocol.instruction_end_request, name, chunk, sync=True, versioned=True)

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """``on_step_begin``/``on_step_end`` around the block (the end also on an exception)."""
        self.on_step_begin(step)
        try:
            yield
        finally:
            self.on_step_end(step)

    @contextmanager
    def instruction(
        self, name: str, microbatch: int | None = None, chunk: int | None = None
    ) -> Iterator[int | None]:
        """``on_instruction_begin``/``_end`` around the block; yields the SM clock."""
        clock = self.on_instruction_begin(name, microbatch, chunk)
        try:
            yield clock
        finally:
            self.on_instruction_end(name, chunk)

    def close(self) -> None:
        """Disconnect for good; later hooks do nothing.

        In pipelined mode, first waits (up to ``reply_timeout_s``) for the pending replies,
        so that every hook sent has been handled by the agent.
        """
        with self._lock:
            self._flush()
            self._closed = True
            self._drop()

    def flush(self) -> bool:
        """Wait until the agent has answered every hook sent (pipelined mode).

        Returns whether it has, within ``reply_timeout_s`` per reply; a stuck agent's
        connection is dropped as in any hook. Synchronous mode has nothing pending.
        """
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        if self._sock is None:
            return not self._pending
        try:
            while self._pending:
                self._pending.read(
                    self._sock,
                    block=True,
                    reply_timeout_s=self.reply_timeout_s,
                    check=self._check_reply,
                )
        except Exception as exc:
            self._fail(f"waiting for replies failed: {failure_reason(exc)}")
            return False
        return True

    def __enter__(self) -> PerseusClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self.connected else "disconnected"
        return f"PerseusClient({self.socket_path!r}, rank={self.rank}, {state})"

    # -- internals

    def _call(
        self,
        build: Callable[..., Mapping[str, Any]],
        *args: Any,
        sync: bool = False,
        versioned: bool = False,
    ) -> Reply | None:
        """``versioned``: ``build`` takes the connection's protocol version (``version=``)."""
        try:
            try:
                request = build(*args)
            except ProtocolError as exc:
                self._warn_misuse(f"invalid hook arguments {args!r}: {exc}")
                return None
            with self._lock:
                if self._closed or (self._sock is None and not self._connect()):
                    return None
                if versioned and self._version != protocol.PROTOCOL_VERSION:
                    try:
                        request = build(*args, version=self._version)
                    except ProtocolError as exc:
                        self._warn_old_agent(f"a hook is not sent: {exc}")
                        return None
                if sync and self.synchronize is not None:
                    self._synchronize()
                if request.get("op") != protocol.OP_HELLO:
                    # The event's own time, after the synchronization: see protocol's t_ns.
                    request = {**request, "t_ns": time.monotonic_ns()}
                return self._request(request)
        except Exception as exc:  # last resort: never raise into training
            self._warn_misuse(f"unexpected error in a hook: {exc!r}")
            return None

    def _synchronize(self) -> None:
        assert self.synchronize is not None
        try:
            self.synchronize()
        except Exception as exc:
            self._warn_misuse(f"synchronize() failed: {exc!r}")

    def _request(self, request: Mapping[str, Any]) -> Reply | None:
        """One round trip on the open connection; on failure drop it and go no-op."""
        sock = self._sock
        assert sock is not None
        op = str(request["op"])
        try:
            if self.pipelined:
                self._pending.send(
                    sock,
                    protocol.encode_request(request),
                    op,
                    max_outstanding=self.max_outstanding,
                    reply_timeout_s=self.reply_timeout_s,
                    check=self._check_reply,
                )
                return None
            reply = roundtrip(sock, self.reply_timeout_s, protocol.encode_request(request), op)
        except Exception as exc:  # OSError, ProtocolError, or anything leaving the stream unsure
            self._fail(f"{op} failed: {failure_reason(exc)}")
            return None
        self._check_reply(reply, op)
        return reply

    def _check_reply(self, reply: Reply, op: str) -> None:
        if reply["ok"]:
            return
        if not self._error_reply_warned:
            self._error_reply_warned = True
            logger.warning("Perseus agent refused %s: %s", op, reply["error"])
        else:
            logger.debug("Perseus agent refused %s: %s", op, reply["error"])

    def _connect(self) -> bool:
        """Connect and say hello, unless the last attempt was too recent. Lock held."""
        now = time.monotonic()
        if now < self._next_attempt:
            return False
        self._next_attempt = now + self.retry_interval_s
        try:
            sock = transport.connect(self.address, self.connect_timeout_s)
        except (OSError, ValueError) as exc:  # ValueError: embedded NUL in the path
            self._fail(f"cannot connect: {failure_reason(exc)}")
            return False
        version = protocol.PROTOCOL_VERSION
        try:
            reply = self._hello(sock, version)
            if refuses_version(reply) and self.needs_protocol_version < version:
                version = 1  # an older agent: its version, on the same connection
                reply = self._hello(sock, version)
        except Exception as exc:
            sock.close()
            self._fail(f"hello failed: {failure_reason(exc)}")
            return False
        if not reply["ok"]:
            sock.close()
            if refuses_version(reply):
                self._fail(
                    f"the agent does not speak protocol version {version} ({reply['error']}), "
                    "which this training process's pipeline schedule needs (chunks of "
                    "interleaved stages or split backwards): upgrade the Perseus node agent"
                )
            else:
                self._fail(f"agent rejected hello: {reply['error']}")
            return False
        if version < protocol.PROTOCOL_VERSION:
            logger.info("The Perseus agent at %s speaks protocol version 1", self.socket_path)
        self._sock = sock
        self._version = version
        self._error_reply_warned = False
        self._connections += 1
        if self._outage_warned:
            logger.warning("Reconnected to the Perseus agent at %s", self.socket_path)
        else:
            logger.info("Connected to the Perseus agent at %s", self.socket_path)
        self._outage_warned = False
        return True

    def _hello(self, sock: socket.socket, version: int) -> Reply:
        hello = protocol.hello_request(
            rank=self.rank,
            local_rank=self.local_rank,
            gpu_uuids=self.gpu_uuids,
            pid=os.getpid(),
            job=self.job,
            namespace=self.namespace,
            pod=self.pod,
            version=version,
        )
        return roundtrip(
            sock, self.reply_timeout_s, protocol.encode_request(hello), protocol.OP_HELLO
        )

    def _fail(self, reason: str) -> None:
        """Drop the connection; warn once per outage. Lock held."""
        self._drop()
        self._next_attempt = time.monotonic() + self.retry_interval_s
        if self._outage_warned:
            logger.debug("Perseus agent at %s still unavailable: %s", self.socket_path, reason)
            return
        self._outage_warned = True
        logger.warning(
            "Perseus agent at %s unavailable (%s); GPU frequency hooks are no-ops, "
            "retrying every %g s",
            self.socket_path,
            reason,
            self.retry_interval_s,
        )

    def _drop(self) -> None:
        self._version = None
        self._pending.clear()
        if self._sock is not None:
            with suppress(OSError):
                self._sock.close()
            self._sock = None

    def _warn_misuse(self, message: str) -> None:
        if self._misuse_warned:
            logger.debug("%s", message)
        else:
            self._misuse_warned = True
            logger.warning("%s (further such messages at debug level)", message)

    def _warn_old_agent(self, message: str) -> None:
        if self._old_agent_warned:
            logger.debug("%s", message)
        else:
            self._old_agent_warned = True
            logger.warning(
                "Perseus agent at %s speaks protocol version 1 only; %s (upgrade the node agent "
                "for this schedule; further such messages at debug level)",
                self.socket_path,
                message,
            )

    def _after_fork_in_child(self) -> None:
        # The parent's connection and lock state are not the child's: start afresh.
        self._lock = threading.Lock()
        self._drop()  # closes the child's copy of the fd only; the parent keeps its connection
        self._next_attempt = 0.0


_clients: weakref.WeakSet[PerseusClient] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for client in list(_clients):
        client._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
