"""The replies a pipelined connection to the agent still awaits (``pipelined=True``).

A pipelined hook sends its request and returns; its reply is read, without blocking, at a
later hook. This module keeps the ops whose replies are still to come, oldest first, and the
bytes received but not yet parsed, and hands each reply to the client's check in order.
:mod:`perseus_client.client` owns the connection and decides what a failure means.

Standard library only (imported inside training processes).
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Callable

from perseus_client import protocol
from perseus_client.protocol import ProtocolError, Reply
from perseus_client.wire import MSG_NOSIGNAL

CheckReply = Callable[[Reply, str], None]
"""Called with each reply and its op, in the order the requests were sent."""


class PendingReplies:
    """Ops sent on one connection whose replies are still to come (``len``: how many)."""

    def __init__(self) -> None:
        self._ops: deque[str] = deque()
        self._received = b""

    def __len__(self) -> int:
        return len(self._ops)

    def clear(self) -> None:
        """Forget everything: the connection they came on is gone."""
        self._ops.clear()
        self._received = b""

    def send(
        self,
        sock: socket.socket,
        data: bytes,
        op: str,
        *,
        max_outstanding: int,
        reply_timeout_s: float,
        check: CheckReply,
    ) -> None:
        """Send without waiting for the reply; first read what replies have arrived."""
        self.read(sock, block=False, reply_timeout_s=reply_timeout_s, check=check)
        if len(self._ops) >= max_outstanding:
            self.read(sock, block=True, reply_timeout_s=reply_timeout_s, check=check)
        sock.settimeout(reply_timeout_s)
        sock.sendall(data, MSG_NOSIGNAL)
        self._ops.append(op)

    def read(
        self, sock: socket.socket, *, block: bool, reply_timeout_s: float, check: CheckReply
    ) -> None:
        """Handle the replies that have arrived; with ``block``, wait for at least one."""
        deadline = time.monotonic() + reply_timeout_s
        handled = 0
        while self._ops:
            end = self._received.find(b"\n") + 1
            if end:
                line, self._received = self._received[:end], self._received[end:]
                op = self._ops.popleft()
                check(protocol.decode_reply(line, op), op)
                handled += 1
                continue
            if len(self._received) > protocol.MAX_MESSAGE_BYTES:
                raise ProtocolError("reply too long")
            if block and not handled:
                remaining = deadline - time.monotonic()
                stuck = TimeoutError(
                    f"{len(self._ops)} replies pending for {reply_timeout_s * 1000:.0f} ms"
                )
                if remaining <= 0:
                    raise stuck
                sock.settimeout(remaining)
                try:
                    chunk = sock.recv(protocol.MAX_MESSAGE_BYTES)
                except TimeoutError:
                    raise stuck from None
            else:
                # Timeout 0, not MSG_DONTWAIT: with a timeout set, Python polls before recv.
                sock.settimeout(0)
                try:
                    chunk = sock.recv(protocol.MAX_MESSAGE_BYTES)
                except BlockingIOError:
                    return
            if not chunk:
                raise ConnectionResetError("agent closed the connection")
            self._received += chunk
        if self._received:
            raise ProtocolError("reply without a request")
